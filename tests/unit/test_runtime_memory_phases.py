"""Memory by phase and by tier (``ZeroEngine.memory_phases``) against ZeRO's formulas.

Here: the one-process checks. The topic's full description and its gloo-world checks are in
``tests/distributed/test_runtime_memory_phases.py``; its CUDA checks are in
``tests/gpu/test_runtime_memory_phases.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.memory_fakes import FakeComponent, FakePool
from zeropp.runtime.memory import (
    CATEGORIES,
    TIERS,
    MemorySnapshot,
    account,
    expected_by_tier,
    expected_memory,
    offload_choices,
    source_tiers,
    tier_totals,
)


def test_device_model_state_falls_as_the_offload_papers_say():
    """ZeRO-Offload (Ren et al. 2021, table 1 / section 4): offloading the optimizer leaves 2Ψ fp16
    parameters + 2Ψ/N gradients on the GPU at stage 2 instead of 2Ψ + 2Ψ/N + 12Ψ/N, host holds 16Ψ/N
    (fp32 master, m, v, fp32 gradients); ZeRO-Infinity (Rajbhandari et al. 2021, table 1/2): stage 3 with
    everything offloaded keeps only the gradient shard on the device and moves the parameter shard too."""
    psi, n = 10**9, 4
    s2 = expected_by_tier(2, psi, n)
    s2_cpu = expected_by_tier(2, psi, n, offload_optimizer="cpu")
    assert tier_totals(s2)["device"] == 2 * psi + 14 * psi / n
    assert tier_totals(s2_cpu)["device"] == 2 * psi + 2 * psi / n and tier_totals(s2_cpu)["host"] == 16 * psi / n
    s3 = tier_totals(expected_by_tier(3, psi, n))
    s3_nvme = tier_totals(expected_by_tier(3, psi, n, offload_optimizer="nvme", offload_param="nvme"))
    s3_cpu = tier_totals(expected_by_tier(3, psi, n, offload_optimizer="cpu", offload_param="cpu"))
    assert s3["device"] == 16 * psi / n
    assert s3_nvme["device"] == s3_cpu["device"] == 2 * psi / n
    # cpu: the host step reads an fp32 gradient copy (4Ψ/N); nvme streams the device's gradient shard
    assert s3_cpu["host"] == 18 * psi / n and s3_nvme["disk"] == 14 * psi / n and s3_nvme["host"] == 0
    # the whole model fits where the sum of the tiers is: totals differ only by the fp32 gradient copy
    assert sum(s3_nvme.values()) == sum(s3.values()) and sum(s3_cpu.values()) == sum(s3.values()) + 4 * psi / n
    # strictly falling device bytes: stage 0 > 1 > 2 > 3 > 3+cpu optimizer > 3+cpu optimizer+params
    chain = [tier_totals(expected_by_tier(s, psi, n))["device"] for s in range(4)]
    chain += [tier_totals(expected_by_tier(3, psi, n, offload_optimizer="cpu"))["device"], s3_cpu["device"]]
    assert all(a > b for a, b in zip(chain, chain[1:])), chain


def test_formula_units():
    psi, n = 1000, 4
    flat = expected_memory(3, psi, n, hpz_size=2)
    t = expected_by_tier(3, psi, n, hpz_size=2)
    assert sum(tier_totals(t).values()) == flat["total"]
    assert expected_memory(1, psi, n, param_bytes=4, shared_master=True)["total"] == 10 * psi
    assert [expected_memory(s, psi, n, param_bytes=4, shared_master=True)["total"] / psi for s in range(4)] == [
        16,
        10,
        7,
        4,
    ]
    # offloaded parameters: the engine keeps the fp32 master apart from the (host) shard, 12 bytes again
    assert expected_by_tier(3, psi, n, param_bytes=4, offload_param="cpu", shared_master=True)["device"] == {
        "params": 0.0,
        "grads": 4 * psi / n,
        "optimizer": 12 * psi / n,
    }
    with pytest.raises(ValueError, match="offload_param"):
        expected_by_tier(2, psi, n, offload_param="cpu")
    with pytest.raises(ValueError, match="stage >= 1"):
        expected_by_tier(0, psi, n, offload_optimizer="cpu")
    assert offload_choices(0) == [("none", "none")] and len(offload_choices(3)) == 9 and len(offload_choices(2)) == 3


def test_account_and_sources_local():
    class U:  # a stand-in FlatUnit: a device shard and a host (offloaded) gradient
        kind, flat, secondary, params = "sharded", None, None, []
        param_shard = torch.zeros(10)
        grad_shard = torch.zeros(5, dtype=torch.bfloat16)

    got = account([U()], {"optimizer": [FakeComponent({"host": 7})], "buffers": [FakePool(3)]}, torch.device("cpu"))
    assert got["device"]["params"] == 40 and got["device"]["grads"] == 10
    assert got["host"]["optimizer"] == 7 and got["device"]["buffers"] == 3
    # a params source owns the shards: not counted twice
    got = account([U()], {"params": [FakeComponent({"host": 40})]}, torch.device("cpu"))
    assert got["device"]["params"] == 0 and got["host"]["params"] == 40
    with pytest.raises(ValueError, match="tiers"):
        source_tiers(FakeComponent({"gpu": 1}))
    with pytest.raises(TypeError, match="memory_by_tier"):
        source_tiers(object())
    with pytest.raises(ValueError, match="category"):
        account([], {"weights": []}, torch.device("cpu"))
    snap = MemorySnapshot(phase="forward", tiers={t: {c: 1 for c in CATEGORIES} for t in TIERS})
    assert snap.total == 15 and snap.to_dict()["tier_totals"]["disk"] == 5
