"""ZeRO-R: activation checkpointing, activation offload and the constant buffer pool.

Here: the gloo-world checks. The topic's full description and its one-process checks are in
``tests/unit/test_runtime_zero_r.py``; its CUDA checks are in ``tests/gpu/test_runtime_zero_r.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from torch import nn

from tests.runtime_helpers import TINY, make_model, rank_batches
from tests.worlds import run_world
from zeropp.comm.spec import QuantSpec
from zeropp.models import GPTConfig

STEPS = 3
BASE = dict(grad_accum_steps=2, grad_clip=0.5)
# 3 blocks and depth 2 exercise prefetch past the running block in both directions
DEEP = GPTConfig(d_model=32, n_layers=3, n_heads=2, seq_len=16)
CASES: dict[str, dict[str, Any]] = {
    "s0": dict(BASE, stage=0),
    "s1": dict(BASE, stage=1),
    "s2": dict(BASE, stage=2),
    "s3": dict(BASE, stage=3),
    "s3_depth2_chunked": dict(BASE, stage=3, prefetch_depth=2, reduce_bucket_size=1000, allgather_bucket_size=1500),
    "s3_depth0": dict(BASE, stage=3, prefetch_depth=0),
    "s3_hpz": dict(BASE, stage=3, hpz=True),
    "s3_qwz_hpz_qgz": dict(BASE, stage=3, hpz=True, weights=QuantSpec(bits=8), grads=QuantSpec(bits=4)),
    "s3_qwz": dict(BASE, stage=3, weights=QuantSpec(bits=8)),
    "s2_qgz": dict(BASE, stage=2, grads=QuantSpec(bits=8)),
}
OFFLOAD = ("s3", "s3_hpz", "s2", "s0")  # also run with zero.offload_activations=True


def _train(rank: int, zero_kwargs: dict[str, Any], ckpt: bool, cfg: GPTConfig) -> dict[str, Any]:
    from zeropp.comm import Topology
    from zeropp.runtime import OptimizerConfig, ZeroConfig, ZeroEngine

    zc = ZeroConfig(**zero_kwargs)
    eng = ZeroEngine(
        make_model(cfg),
        config=zc,
        optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.01),
        topology=Topology(nodes=2, ranks_per_node=2),
        activation_checkpointing=ckpt,
    )
    try:
        losses, allocs, tiers = [], [], []
        for s in range(STEPS):
            losses.append(eng.train_step(rank_batches(s, zc.grad_accum_steps, rank, cfg)).loss)
            allocs.append(eng.buffers.allocations)
            tiers.append(eng.activations.memory_by_tier())
        weights = {k: v.numpy() for k, v in eng.consolidated_state_dict().items()}
        return {
            "losses": losses,
            "weights": weights,
            "allocs": allocs,
            "tiers": tiers,
            "pool_bytes": eng.buffers.nbytes,
            "in_use": eng.buffers.in_use,
        }
    finally:
        eng.close()


def _world(rank: int, world: int) -> dict[str, Any]:
    out = {}
    for name, kw in CASES.items():
        cfg = DEEP if name.startswith("s3_depth") else TINY
        out[name] = _train(rank, kw, False, cfg)
        out[name + "+ckpt"] = _train(rank, kw, True, cfg)
    for name in OFFLOAD:
        out[name + "+offload"] = _train(rank, dict(CASES[name], offload_activations=True), False, TINY)
        out[name + "+ckpt+offload"] = _train(rank, dict(CASES[name], offload_activations=True), True, TINY)
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_world(_world, 4, timeout=400)


def _same(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    assert a["losses"] == b["losses"], (what, a["losses"], b["losses"])
    assert set(a["weights"]) == set(b["weights"])
    for k in a["weights"]:
        assert np.array_equal(a["weights"][k], b["weights"][k]), (what, k)


@pytest.mark.parametrize("name", list(CASES))
def test_checkpointing_is_exact(runs, name):
    for r in runs:
        _same(r[name + "+ckpt"], r[name], f"{name} with activation checkpointing")


@pytest.mark.parametrize("name", OFFLOAD)
def test_activation_offload_is_exact(runs, name):
    for r in runs:
        _same(r[name + "+offload"], r[name], f"{name} with offload_activations")
        _same(r[name + "+ckpt+offload"], r[name], f"{name} with checkpointing and offload_activations")


def test_training_moves_the_weights(runs):
    """Guard against a vacuous comparison: the runs train (losses change step to step)."""
    losses = runs[0]["s3"]["losses"]
    assert len(set(losses)) == STEPS, losses


def test_activation_bytes_by_tier(runs):
    r = runs[0]
    base, ckpt = r["s3"]["tiers"][-1], r["s3+ckpt"]["tiers"][-1]
    assert set(base) == {"device", "host", "disk"}
    assert base["host"] == base["disk"] == 0 and base["device"] > 0
    # checkpointing keeps only each block's input ([B, T, D] fp32) of the blocks' activations
    assert 0 < ckpt["device"] < base["device"]
    block_inputs = TINY.n_layers * 2 * TINY.seq_len * TINY.d_model * 4
    assert base["device"] - ckpt["device"] > 5 * block_inputs
    for name in ("s3", "s3+ckpt"):  # offload: every saved activation is copied to the host
        off = r[name + "+offload"]["tiers"][-1]
        assert off["device"] == 0 and off["host"] > 0, (name, off)
    # with checkpointing, what goes to the host is (about) the blocks' inputs plus the layers outside the blocks
    assert r["s3+ckpt+offload"]["tiers"][-1]["host"] < r["s3+offload"]["tiers"][-1]["host"]


def test_pool_is_constant_after_the_first_step(runs):
    for r in runs:
        for name, res in r.items():
            a = res["allocs"]
            assert a[0] == a[-1], (name, a)  # no new gather / reduce buffer after the first step
            assert res["in_use"] == 0, name  # everything handed out came back
    r = runs[0]
    assert r["s0"]["pool_bytes"] == 0  # stage 0 all-reduces the gradient in place: nothing to pool
    assert r["s3"]["pool_bytes"] == _pool_formula(TINY, depth=1, stage=3)
    assert r["s3_depth2_chunked"]["pool_bytes"] == _pool_formula(DEEP, depth=2, stage=3)
    assert r["s2"]["pool_bytes"] == _pool_formula(TINY, depth=0, stage=2)
    assert r["s1"]["pool_bytes"] == _pool_formula(TINY, depth=0, stage=1)


def _pool_formula(cfg: GPTConfig, *, depth: int, stage: int, world: int = 4) -> int:
    """fp32 pool bytes: stage 3 gathers (root + (depth + 1) blocks), stages 2-3 two reduce-scatter
    inputs [padded] and outputs [S], stage 1 one input; every unit padded to a multiple of ``world``."""
    d, v, t, m = cfg.d_model, cfg.vocab_size, cfg.seq_len, cfg.mlp_ratio
    block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (m * d * d + m * d) + (m * d * d + d)
    root = v * d + t * d + 2 * d + (0 if cfg.tie_embeddings else d * v) + v  # a tied head weight is the embedding
    pad = lambda n: -(-n // world) * world  # noqa: E731
    big = max(pad(block), pad(root))
    n = 0
    if stage == 3:
        n += pad(root) + (depth + 1) * pad(block)
    if stage >= 2:
        n += 2 * big + 2 * (big // world)
    elif stage == 1:
        n += big
    return 4 * n


class _NoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, idx, targets=None):
        return None, self.lin(idx.float()).sum()


def _no_blocks(rank: int, world: int) -> str:
    from zeropp.runtime import ZeroConfig, ZeroEngine

    try:
        ZeroEngine(_NoBlocks(), config=ZeroConfig(stage=3), activation_checkpointing=True)
    except ValueError as e:
        return str(e)
    return "no error"


def test_checkpointing_without_blocks_is_a_clear_error():
    msg = run_world(_no_blocks, 1)[0]
    assert "activation_checkpointing" in msg and "blocks" in msg, msg
