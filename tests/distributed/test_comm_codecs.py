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

from tests.comm_helpers import (
    CHECK_CALLS_ENV,
    bytes_of,
    expected_all_gather_bytes,
    expected_reduce_scatter_bytes,
    rank_input,
)
from tests.toy_codec import OFFSET, OffsetCodec
from tests.worlds import run_world
from zeropp.comm import (
    CommStats,
    ReduceOp,
    Topology,
    default_session,
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


# ----------------------------------------------------------------------------------------------
# Every registered codec (tests/codec_cases.py) in one world: all-gather, both reduce-scatters,
# error feedback on qgZ's two hops. The reference is built from the codec's own operations in the
# order the collectives apply them, so what is checked is the collectives' routing, order and
# bytes for each codec (each codec's arithmetic is checked against its kernels' reference in
# tests/unit/test_comm_codecs.py and tests/unit/test_kernels_formats.py).
# ----------------------------------------------------------------------------------------------
def _rows_of(codec, xs: list[torch.Tensor], bits: int, gs: int) -> torch.Tensor:
    """Each [n] row encoded alone, stacked: uint8 [k, 1, B]."""
    return torch.stack([codec.encode(x.view(1, -1), bits, gs, rows=1, seed=None) for x in xs])


def _registry_world(rank: int, W: int) -> dict:
    from tests.codec_cases import registry_specs, two_hop_specs
    from zeropp.comm import ErrorFeedback
    from zeropp.comm.codecs import codec_for

    topo2x2, topo1x4 = Topology(2, 2), Topology(1, 4)
    stats = CommStats()
    checked: list[str] = []
    n = 37
    xs = [rank_input(31, r, n, torch.float32) for r in range(W)]
    for spec in registry_specs(group_size=16):
        c, gs = codec_for(spec), spec.group_size
        out = torch.empty(W * n)
        stats.reset()
        quantized_all_gather(out, xs[rank], spec=spec, topology=topo2x2, stats=stats)
        want = torch.cat(
            [c.dequantize(c.unpack(_rows_of(c, [x], spec.bits, gs)[0], n, spec.bits, gs)).view(-1) for x in xs]
        )
        assert torch.equal(out, want), ("all-gather", spec.label)
        assert bytes_of(stats, "all_gather") == expected_all_gather_bytes(topo2x2, n, 4, spec.bits, gs, spec=spec)
        checked.append(f"ag {spec.label}")

    n = 45
    xs = [rank_input(32, r, W * n, torch.float32) for r in range(W)]
    chunks = [x.view(W, n)[rank] for x in xs]  # every rank's chunk for me
    rpn, nodes = 2, 2
    for spec in two_hop_specs(group_size=16):
        c, gs, (ib, bits) = codec_for(spec), spec.group_size, spec.hop_bits
        # single hop inside one node (1x4): one all-to-all at the intra bits, then the dequantize-sum
        out = torch.empty(n)
        stats.reset()
        quantized_reduce_scatter(out, xs[rank], ReduceOp.SUM, spec=spec, topology=topo1x4, stats=stats)
        assert torch.equal(out, c.dequantize_sum(_rows_of(c, chunks, ib, gs), n, ib, gs).view(-1)), spec.label
        assert bytes_of(stats, "reduce_scatter") == expected_reduce_scatter_bytes(topo1x4, n, 4, bits, ib, gs, spec)
        # qgZ on 2x2: node a sums its ranks' chunks at `ib`, re-quantizes at `bits`, node sums added here
        hop2 = [
            c.dequantize_sum_requantize(
                _rows_of(c, chunks[a * rpn : (a + 1) * rpn], ib, gs), n, ib, gs, out_bits=bits, seed=None
            )
            for a in range(nodes)
        ]
        want = c.dequantize_sum(torch.stack(hop2), n, bits, gs).view(-1) / W
        out = torch.empty(n)
        stats.reset()
        quantized_reduce_scatter(out, xs[rank], ReduceOp.AVG, spec=spec, topology=topo2x2, stats=stats)
        assert torch.equal(out, want), ("qgZ", spec.label)
        assert bytes_of(stats, "reduce_scatter") == expected_reduce_scatter_bytes(topo2x2, n, 4, bits, ib, gs, spec)
        # error feedback on both hops: a zero residual changes nothing; then both hops keep residuals
        ef_spec = spec.replace(error_feedback=True, residual_bits=32)
        ef = ErrorFeedback.for_spec(ef_spec)
        first = torch.empty(n)
        quantized_reduce_scatter(
            first, xs[rank], ReduceOp.AVG, spec=ef_spec, error_feedback=ef, feedback_key="b", topology=topo2x2
        )
        assert torch.equal(first, want), ("EF first call", spec.label)
        assert sorted(ef.keys()) == ["b", "b@hop2"]
        assert all(
            float(ef.residual(k, m, torch.device("cpu")).abs().max()) > 0
            for k, m in (("b", W * n), ("b@hop2", nodes * n))
        )
        second = torch.empty(n)
        quantized_reduce_scatter(
            second, xs[rank], ReduceOp.AVG, spec=ef_spec, error_feedback=ef, feedback_key="b", topology=topo2x2
        )
        assert not torch.equal(second, want), ("EF second call sends the residuals", spec.label)
        # two calls with feedback deliver the two inputs' sum more exactly than two without
        exact = 2 * _exact(chunks, 1.0 / W)
        assert float((first.double() + second.double() - exact).abs().sum()) < float(
            (2 * want.double() - exact).abs().sum()
        ), spec.label
        checked.append(f"rs {spec.label}")
    return {"checked": checked, "check_collectives": default_session().check_collectives}


def test_every_registered_codec_in_every_collective() -> None:
    res = run_world(_registry_world, 4, timeout=240, env=CHECK_CALLS_ENV)  # every call checked, too
    assert all(r["check_collectives"] for r in res)
    labels = res[0]["checked"]
    assert {
        "ag int8g16",
        "ag mxfp6",
        "ag nvfp4",
        "ag fp8g16",
        "ag mxint8",
        "rs int8/4g16",
        "rs mxfp8/4",
        "rs nvfp4",
    } <= set(labels)
