"""The codec registry: a scheme registered in a test reaches every collective unchanged.

The toy scheme ``offset`` is the ``int`` codec applied to ``x + OFFSET`` (and ``OFFSET``
subtracted after dequantizing), a stand-in for schemes that transform values before the integer
quantizer (Hadamard rotation, weight differences). It implements only the required codec methods,
so qgZ's sums and its hierarchical re-quantization run through the generic ``Codec`` reductions.
Each collective's result must equal the toy scheme's own reference (built from the kernels with
the documented arithmetic order), bit for bit, and differ from the ``int`` result.

Here: the gloo-world checks of this topic; its other tiers' checks are in ``tests/unit/test_comm_codecs.py``.
"""

from __future__ import annotations

from typing import Optional

import torch

from tests.comm_helpers import bytes_of, expected_all_gather_bytes, expected_reduce_scatter_bytes, rank_input
from tests.toy_codec import OFFSET, OffsetCodec
from tests.worlds import run_world
from zeropp.comm import (
    CommStats,
    ReduceOp,
    Topology,
    quantized_all_gather,
    quantized_all_reduce,
    quantized_reduce_scatter,
    reset_stochastic_calls,
    stochastic_seed,
)
from zeropp.comm.codecs import register_codec
from zeropp.comm.spec import QuantSpec
from zeropp.kernels import dequantize, quantize

SEED = 77


def _rt(x: torch.Tensor, bits: int, gs: int, seed: Optional[int] = None) -> torch.Tensor:
    """Reference round trip of one row ``x`` ([n]) through the toy: fp32 [n]."""
    kw = {} if seed is None else dict(stochastic=True, seed=seed)
    return dequantize(quantize(x.float() + OFFSET, bits, gs, rows=1, **kw)).view(-1) - OFFSET


def _sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """The generic dequantize-sum's order: fp32 zeros, then each source in order."""
    acc = torch.zeros_like(parts[0])
    for p in parts:
        acc += p
    return acc


def _world(rank: int, W: int) -> dict:
    register_codec("offset", OffsetCodec(), bits=(8, 4))
    topo2x2, topo1x4 = Topology(2, 2), Topology(1, 4)
    stats = CommStats()
    res: dict = {}

    # all-gather (8 and 4 bits, nearest and stochastic): each shard through the toy once
    n = 37
    xs = [rank_input(21, r, n, torch.float32) for r in range(W)]
    for bits in (8, 4):
        for stochastic in (False, True):
            spec = QuantSpec(
                bits=bits, group_size=16, scheme="offset", rounding="stochastic" if stochastic else "nearest", seed=SEED
            )
            reset_stochastic_calls(3)
            out = torch.empty(W * n)
            stats.reset()
            quantized_all_gather(out, xs[rank], spec=spec, topology=topo2x2, stats=stats)
            seeds = [stochastic_seed(SEED, r, 3) if stochastic else None for r in range(W)]
            want = torch.cat([_rt(xs[r], bits, 16, seeds[r]) for r in range(W)])
            assert torch.equal(out, want), ("all-gather", bits, stochastic)
            assert bytes_of(stats, "all_gather") == expected_all_gather_bytes(topo2x2, n, 4, bits, 16)
            reset_stochastic_calls(3)
            plain_int = torch.empty(W * n)
            quantized_all_gather(plain_int, xs[rank], spec=spec.replace(scheme="int"), topology=topo2x2, stats=stats)
            assert not torch.equal(out, plain_int), "the toy scheme must not be the int codec"

    # reduce-scatter: single hop (1x4 view of the world) and hierarchical (2x2, generic re-quantization)
    n, gs = 29, 8
    xs = [rank_input(22, r, W * n, torch.float32) for r in range(W)]
    chunks = [x.view(W, n)[rank] for x in xs]  # every rank's chunk for me
    for topo in (topo1x4, topo2x2):
        spec = QuantSpec(bits=4, intra_bits=8, group_size=gs, scheme="offset")
        for op, post in ((ReduceOp.SUM, 1.0), (ReduceOp.AVG, 1.0 / W)):
            out = torch.empty(n)
            stats.reset()
            quantized_reduce_scatter(out, xs[rank], op, spec=spec, topology=topo, stats=stats)
            if topo.nodes == 1:
                want = _sum([_rt(c, 8, gs) for c in chunks])  # one node: the intra hop's bits
            else:
                rpn = topo.ranks_per_node
                node_sums = [_sum([_rt(chunks[a * rpn + lp], 8, gs) for lp in range(rpn)]) for a in range(topo.nodes)]
                want = _sum([_rt(s, 4, gs) for s in node_sums])
            want = want * post if post != 1.0 else want
            assert torch.equal(out, want), ("reduce-scatter", topo, op)
            assert bytes_of(stats, "reduce_scatter") == expected_reduce_scatter_bytes(topo, n, 4, 4, 8, gs)
            int_out = torch.empty(n)
            quantized_reduce_scatter(int_out, xs[rank], op, spec=spec.replace(scheme="int"), topology=topo, stats=stats)
            assert not torch.equal(out, int_out)
            res[f"rs_{topo.nodes}x{topo.ranks_per_node}_err"] = float((out.double() - _exact(chunks, post)).abs().max())

    # all-reduce (the DDP hook's collective): both halves through the toy, close to the exact mean
    t = rank_input(23, rank, 50, torch.float32)
    ref = torch.stack([rank_input(23, r, 50, torch.float32) for r in range(W)]).mean(0)
    quantized_all_reduce(
        t,
        spec=QuantSpec(bits=8, scheme="offset"),
        gather_spec=QuantSpec(bits=8, scheme="offset"),
        topology=topo2x2,
        stats=stats,
    )
    assert torch.allclose(t, ref, atol=float(ref.abs().max() + OFFSET) / 30)
    return res


def _exact(chunks: list[torch.Tensor], post: float) -> torch.Tensor:
    return torch.stack([c.double() for c in chunks]).sum(0) * post


def test_registered_codec_runs_in_every_collective() -> None:
    res = run_world(_world, 4, timeout=120)
    assert all(r.keys() == res[0].keys() for r in res)
