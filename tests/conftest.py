"""Test-wide setup. TRITON_INTERPRET must be set before triton is first imported so the Triton
kernels run on CPU tensors; nothing in the suite needs a GPU."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

import pytest  # noqa: E402  (after the environment above)
import torch  # noqa: E402


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules of small single-process tensors: on the shared 2-core machine intra-op threads
    only add waiting (a parallel region waits for its slowest, often descheduled, thread).
    Use with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``; restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
