"""The scaling cost model: exact message sizes, and the ZeRO++ paper's direction and size."""

from __future__ import annotations

import math

import pytest

from zeropp.experiments.scaling import (
    ZEROPP, Cluster, Workload, gpt_units, messages, node_cross_bytes, pairwise_bytes, paper_workload, project,
    speedup_table,
)
from zeropp.kernels import quantized_nbytes

UNITS = gpt_units(vocab=256, seq_len=64, d_model=64, n_layers=2)


def _w(**kw: object) -> Workload:
    return Workload(units=UNITS, compute_s=0.01, tokens_per_rank=512, dtype_bytes=4, **kw)  # type: ignore[arg-type]


def test_units_match_the_model() -> None:
    from zeropp.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=256, seq_len=64, d_model=64, n_layers=2, n_heads=2)
    assert sum(UNITS) == sum(p.numel() for p in GPT(cfg).parameters())
    assert UNITS[1] == sum(p.numel() for p in GPT(cfg).blocks[0].parameters())


def test_pairwise_bytes_equal_the_formulas() -> None:
    c = Cluster(nodes=2, ranks_per_node=2, cross_gbps=10)
    W = c.world
    shards = [-(-u // W) for u in UNITS]
    # plain ZeRO-3: each rank sends its shard to 1 intra and 2 cross peers, three times (fwd, bwd, grads)
    b = pairwise_bytes(messages(_w(), c))
    for kind in ("fwd_all_gather", "bwd_all_gather", "grad_reduce_scatter"):
        assert b[f"{kind}.intra"] == sum(4 * s for s in shards)
        assert b[f"{kind}.cross"] == 2 * sum(4 * s for s in shards)
    # qwZ INT8: the shard travels quantized (codes + one fp32 scale per 512)
    b = pairwise_bytes(messages(_w(qwz_bits=8), c))
    assert b["fwd_all_gather.cross"] == 2 * sum(quantized_nbytes(1, s, 8, 512) for s in shards)
    # hpZ: the backward gather never leaves the node
    b = pairwise_bytes(messages(_w(hpz=True), c))
    assert "bwd_all_gather.cross" not in b and b["bwd_all_gather.intra"] > 0
    # qgZ INT4: one quantized row per remote node, N rows to each local peer
    b = pairwise_bytes(messages(_w(qgz_bits=4), c))
    assert b["grad_a2a_cross.cross"] == sum(quantized_nbytes(1, s, 4, 128) for s in shards)
    assert b["grad_a2a_intra.intra"] == sum(quantized_nbytes(2, s, 4, 128) for s in shards)


def test_cross_node_volume_is_3m_vs_075m() -> None:
    """Per node, ZeRO-3 moves ~3M across nodes and ZeRO++ ~0.75M (fp16 -> INT8 weights, INT4 grads)."""
    w = Workload(units=(1 << 24,) * 4, compute_s=1.0, tokens_per_rank=1, dtype_bytes=2)
    c = Cluster(nodes=64, ranks_per_node=8, cross_gbps=100)
    m = sum(w.units) * 2
    base = node_cross_bytes(messages(w, c), c) / m
    plus = node_cross_bytes(messages(w.with_zero(**ZEROPP), c), c) / m
    assert base == pytest.approx(3 * 63 / 64, rel=1e-3)
    assert plus == pytest.approx(0.75 * 63 / 64, rel=0.05)  # scales cost a few percent


def test_paper_direction_and_size() -> None:
    """About 2x at 100 Gbps on hundreds of GPUs, much less at 400 Gbps, ~nothing on one node."""
    rows = speedup_table(paper_workload(), gbps=(100.0, 400.0), ranks_per_node=8, max_ranks=384)
    at = {(r["gbps"], r["gpus"]): r["speedup"] for r in rows}
    assert 1.6 < at[(100.0, 384)] < 2.6
    assert at[(400.0, 384)] < at[(100.0, 384)] - 0.4
    assert 1.0 <= at[(400.0, 384)] < 1.6
    assert at[(100.0, 8)] < 1.1  # one node: nothing crosses a NIC
    s100 = [at[(100.0, g)] for g in sorted(g for b, g in at if b == 100.0)]
    assert all(b >= a - 1e-9 for a, b in zip(s100, s100[1:]))  # grows with the number of nodes


def test_more_bandwidth_never_slower() -> None:
    w = paper_workload()
    for bw_lo, bw_hi in ((100, 200), (200, 400), (400, 800)):
        lo = project(w, Cluster(nodes=8, ranks_per_node=8, cross_gbps=bw_lo)).step_s
        hi = project(w, Cluster(nodes=8, ranks_per_node=8, cross_gbps=bw_hi)).step_s
        assert hi <= lo and math.isfinite(hi)
