"""Test-wide setup.

On CPU, Triton kernels run under ``TRITON_INTERPRET=1`` (set before triton is first imported) so
they can be checked against their torch references. A GPU session (``pytest -m cuda``) must run the
compiled kernels instead, so the interpreter is left off when the selection asks for the ``cuda``
tests; those skip themselves where CUDA is absent.
"""

import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


def pytest_configure(config: pytest.Config) -> None:
    markexpr = (config.getoption("markexpr", default="") or "").replace(" ", "")
    gpu_run = "cuda" in markexpr and "notcuda" not in markexpr
    if not gpu_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules of small single-process tensors: on the shared 2-core machine intra-op threads
    only add waiting (a parallel region waits for its slowest, often descheduled, thread).
    Use with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``; restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
