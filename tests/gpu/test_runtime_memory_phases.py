"""Memory by phase and by tier (``ZeroEngine.memory_phases``) against ZeRO's formulas.

Here: the CUDA checks. The topic's full description and its gloo-world checks are in
``tests/distributed/test_runtime_memory_phases.py``; its one-process checks are in
``tests/unit/test_runtime_memory_phases.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.memory_fakes import FakePool


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peak_comes_from_the_allocator_and_resets_per_phase():
    from zeropp.runtime.memory import reset_peak, snapshot

    dev = torch.device("cuda", torch.cuda.current_device())
    base = torch.cuda.memory_allocated(dev)  # what earlier tests in this process still hold
    reset_peak(dev)
    big = torch.empty(64 << 20, dtype=torch.uint8, device=dev)  # 64 MiB, freed before the snapshot
    del big
    snap = snapshot("forward", [], {"buffers": [FakePool(10)]}, dev)
    assert snap.peak_source == "cuda_allocator" and snap.peak >= base + (64 << 20)
    assert snap.process["allocated"] < snap.peak and snap.tiers["device"]["buffers"] == 10
    # the figures read from the allocator's nested statistics are torch's own
    assert snap.process["allocated"] == torch.cuda.memory_allocated(dev)
    assert snap.process["reserved"] == torch.cuda.memory_reserved(dev)
    assert snap.peak == torch.cuda.max_memory_allocated(dev)
    reset_peak(dev)
    assert snapshot("backward", [], {}, dev).peak < base + (64 << 20)
