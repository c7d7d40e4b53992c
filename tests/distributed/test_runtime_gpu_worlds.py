"""The multi-GPU cuda tests' own logic, on gloo ranks.

The runtime tests in ``tests/gpu`` that need an NCCL world of two GPUs skip on a machine with one,
which is all a lent GPU machine has, so a mistake in what they do around the engine (which rank
returns what, the folders they hand it) would first show on a rare multi-GPU machine, as a failed
test instead of a verdict. Here their rank functions run on CPU ranks: the switch to NCCL is
skipped, ``.cuda()`` leaves a tensor or module where it is, and the allocator's figures read 0. So
the results, the checkpoint round trips and the exactness checks are judged as on the GPUs; the GPU
memory bounds hold trivially and are left to the GPUs.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
import torch

from tests.parity_helpers import STAGES, check_parity


def _on_cpu(name: str) -> ModuleType:
    """In a rank process (a fresh fork each world): the cuda test module ``name`` with its NCCL
    setup skipped, ``.cuda()`` the identity and the CUDA allocator's figures 0."""
    import importlib

    import tests.runtime_helpers as helpers

    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    torch.nn.Module.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.reset_peak_memory_stats = lambda *a, **k: None
    torch.cuda.memory_allocated = lambda *a, **k: 0
    torch.cuda.max_memory_allocated = lambda *a, **k: 0
    helpers.nccl_world = lambda *a, **k: None
    module = importlib.import_module(name)
    if hasattr(module, "nccl_world"):  # imported by name at the module's top
        setattr(module, "nccl_world", helpers.nccl_world)  # noqa: B010 (setattr: not an attribute of the module mypy sees)
    return module


def _parity_rank(rank: int, world: int, *args: Any) -> Any:
    """``test_runtime_cuda._nccl_world`` with the engines on the CPU."""
    m = _on_cpu("tests.gpu.test_runtime_cuda")
    real = getattr(m, "parity_world")  # noqa: B009
    setattr(m, "parity_world", lambda *a, device="cpu", **k: real(*a, device="cpu", **k))  # noqa: B010
    return m._nccl_world(rank, world, *args)


def _tiers_rank(rank: int, world: int, *args: Any) -> Any:
    """``test_runtime_checkpoint_tiers_cuda._world`` with the engines on the CPU."""
    return _on_cpu("tests.gpu.test_runtime_checkpoint_tiers_cuda")._world(rank, world, *args)


def test_the_world_two_stage_parity_test_judges_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank reports its checkpoint round trip and keeps a result per stage for the parity check."""
    import tests.gpu.test_runtime_cuda as m

    monkeypatch.setattr(m, "_nccl_world", _parity_rank)
    res = m._run(2)
    assert [len(r) for r in res] == [len(STAGES)] * 2
    check_parity(res, 2, STAGES)


def test_the_offload_checkpoint_tiers_test_runs_through(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole test (its three engines: in memory, cpu, nvme with a swap folder of each rank's
    own), on CPU ranks: every state saved and loaded exactly."""
    import tests.gpu.test_runtime_checkpoint_tiers_cuda as m

    monkeypatch.setattr(m, "_world", _tiers_rank)
    m.test_offload_checkpoints_keep_host_state_off_the_gpu()
