"""Memory by phase and by tier (``ZeroEngine.memory_phases``) against ZeRO's formulas.

One 2-node x 2-rank gloo world trains the tiny GPT for one step per configuration and returns
each engine's snapshots. Checked: the five phases exist; model creation holds no optimizer state
and optimizer creation all of it, on its tier; at the end of backward (all model state
alive) each tier's params / grads / optimizer bytes are within 5% of ``expected_by_tier``
(the ZeRO table placed on tiers); the tiers add up to the flat ``memory_report``; registered
components (activations, buffers) land under their category and tier; the CPU peak is the
accounted device total and the RSS figures are there.

Offload rows run when the engine has the offload pieces (an optimizer-state holder with
``memory_by_tier``, a parameter store registered with ``track_memory("params", ...)``); where
``ZeroEngine`` accepts the option but has no such piece yet, they skip saying so.

Here: the CUDA checks of this topic; its other tiers' checks are in
``tests/unit/test_runtime_memory_phases.py``, ``tests/distributed/test_runtime_memory_phases.py``.
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
    reset_peak(dev)
    assert snapshot("backward", [], {}, dev).peak < base + (64 << 20)
