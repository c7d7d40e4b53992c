"""Hadamard-rotated quantization in the codec and the collectives (``QuantSpec.rotation``).

Every result is compared bit for bit with a composition of the kernels' torch reference
functions in the documented order: rotate (``hadamard_ref``, rows zero padded to whole blocks),
quantize, (qgZ: sum and re-quantize in the rotated basis), dequantize-sum, rotate back keeping
the original length, scale. The bytes on the wire must be exactly the unrotated int codec's.

Here: the gloo-world checks of this topic; its other tiers' checks are in
``tests/unit/test_comm_hadamard.py``.
"""

from __future__ import annotations

import torch

from tests.comm_helpers import bytes_of, expected_all_gather_bytes, expected_reduce_scatter_bytes, rank_input
from tests.hadamard_reference import had, q_rot, round_trip, unrot
from tests.kernel_helpers import stack
from tests.worlds import run_world
from zeropp.comm import (
    CommStats,
    ErrorFeedback,
    ReduceOp,
    Topology,
    quantized_all_gather,
    quantized_all_reduce,
    quantized_reduce_scatter,
    reset_stochastic_calls,
    stochastic_seed,
)
from zeropp.comm.qgz import swizzle
from zeropp.comm.spec import QuantSpec
from zeropp.kernels import QuantizedTensor
from zeropp.kernels.reference import dequantize_sum_ref, dequantize_sum_requantize_ref

SEED = 91


# ------------------------------------------------------------------------------ reference pieces
def rows_of(q: QuantizedTensor, a: int, b: int) -> QuantizedTensor:
    return QuantizedTensor(q.codes[a:b], q.scales[a:b], q.cols, q.bits, q.group_size)


# ------------------------------------------------------------------------------ collectives, 4 gloo ranks
def _gathers(rank: int, W: int, topo: Topology, stats: CommStats) -> None:
    for n in (1, 37):
        _gathers_of(n, rank, W, topo, stats)
    # the weights' default group size (512 = the block), a row longer than one block
    n = 600
    x = rank_input(32, rank, n, torch.bfloat16)
    out = torch.empty(W * n, dtype=torch.bfloat16)
    quantized_all_gather(out, x, spec=QuantSpec(bits=4, rotation="hadamard"), topology=topo, stats=stats)
    want = torch.cat(
        [round_trip(rank_input(32, r, n, torch.bfloat16), 512, 4, 512, dtype=torch.bfloat16).view(-1) for r in range(W)]
    )
    assert torch.equal(out, want)


def _gathers_of(n: int, rank: int, W: int, topo: Topology, stats: CommStats) -> None:
    xs = [rank_input(31, r, n, torch.float32) for r in range(W)]
    for spec, b in ((had(4, 16), 16), (had(8, 96, 32), 32), (had(4, 16, rounding="stochastic", seed=SEED), 16)):
        for out_dtype in (torch.float32, torch.bfloat16):
            reset_stochastic_calls(3)
            out = torch.empty(W * n, dtype=out_dtype)
            stats.reset()
            quantized_all_gather(out, xs[rank], spec=spec, topology=topo, stats=stats)
            seeds = [stochastic_seed(SEED, r, 3) if spec.stochastic else None for r in range(W)]
            want = torch.cat(
                [
                    round_trip(xs[r], b, spec.bits, spec.group_size, seed=seeds[r], dtype=out_dtype).view(-1)
                    for r in range(W)
                ]
            )
            assert torch.equal(out, want), ("all-gather", spec.label, out_dtype)
            assert bytes_of(stats, "all_gather") == expected_all_gather_bytes(topo, n, 4, spec.bits, spec.group_size)


def _reduce_scatters(rank: int, W: int, stats: CommStats) -> None:
    for n in (1, 29):
        _reduce_scatters_of(n, rank, W, stats)


def _reduce_scatters_of(n: int, rank: int, W: int, stats: CommStats) -> None:
    xs = [rank_input(33, r, W * n, torch.float32) for r in range(W)]
    for gs, block in ((8, None), (16, 4)):
        b = gs if block is None else block
        spec = had(4, gs, block, intra_bits=8)
        for topo in (Topology(1, 4), Topology(2, 2)):
            for in_dtype, out_dtype in (
                (torch.float32, torch.float32),
                (torch.bfloat16, torch.bfloat16),
                (torch.float32, torch.bfloat16),
            ):
                chunks = [x.to(in_dtype).view(W, n)[rank] for x in xs]  # every rank's chunk for me
                exact = _rs_reference(chunks, topo, b, gs)
                for op, post in ((ReduceOp.SUM, 1.0), (ReduceOp.AVG, 1.0 / W)):
                    out = torch.empty(n, dtype=out_dtype)
                    stats.reset()
                    quantized_reduce_scatter(out, xs[rank].to(in_dtype), op, spec=spec, topology=topo, stats=stats)
                    # the fp32 sum, rotated back, scaled, then rounded once to the output dtype
                    want = (exact * post if post != 1.0 else exact).to(out_dtype)
                    assert torch.equal(out, want), ("reduce-scatter", n, topo, gs, block, op, in_dtype, out_dtype)
                    assert bytes_of(stats, "reduce_scatter") == expected_reduce_scatter_bytes(topo, n, 4, 4, 8, gs)


def _rs_reference(chunks: list[torch.Tensor], topo: Topology, b: int, gs: int) -> torch.Tensor:
    """qgZ SUM of my chunk (INT8 intra hop, INT4 cross hop) from reference functions: fp32 [n]."""
    rpn, n = topo.ranks_per_node, chunks[0].numel()
    if topo.nodes == 1:  # one node: one hop at the intra bits
        total = dequantize_sum_ref(stack([q_rot(c, b, 8, gs) for c in chunks]))
    else:  # node partial sums re-quantized in the rotated basis, then summed in node order
        node_sums = [
            dequantize_sum_requantize_ref(stack([q_rot(chunks[a * rpn + lp], b, 8, gs) for lp in range(rpn)]), 4, gs)
            for a in range(topo.nodes)
        ]
        total = dequantize_sum_ref(stack(node_sums))
    return unrot(total, b, n).view(-1)  # rotated back once


def _stochastic_2x2(rank: int, W: int, stats: CommStats) -> None:
    """Seeds as documented: the intra hop (seed, r, call, 0) on each rank's whole swizzled, rotated
    input; the node re-quantization (seed, r, call, 1), in the rotated basis."""
    topo = Topology(2, 2)
    nodes, rpn, n, gs, ib, bits = 2, 2, 150, 64, 8, 4
    spec = had(bits, gs, intra_bits=ib, rounding="stochastic", seed=SEED)
    xs = [rank_input(34, r, W * n, torch.float32) for r in range(W)]
    reset_stochastic_calls(5)
    out = torch.empty(n)
    quantized_reduce_scatter(out, xs[rank], spec=spec, topology=topo, stats=stats)
    first = [
        q_rot(swizzle(xs[r].view(W, n), nodes, rpn), gs, ib, gs, rows=W, seed=stochastic_seed(SEED, r, 5, 0))
        for r in range(W)
    ]
    node, local = divmod(rank, rpn)
    sums = []
    for a in range(nodes):
        pieces = stack([rows_of(first[a * rpn + lp], local * nodes, (local + 1) * nodes) for lp in range(rpn)])
        q2 = dequantize_sum_requantize_ref(
            pieces, bits, gs, stochastic=True, seed=stochastic_seed(SEED, a * rpn + local, 5, 1)
        )
        sums.append(rows_of(q2, node, node + 1))
    want = unrot(dequantize_sum_ref(stack(sums)), gs, n).view(-1) * (1.0 / W)
    assert torch.equal(out, want)


def _error_feedback(rank: int, W: int, stats: CommStats) -> None:
    """The residual is kept in the plain basis: x minus its rotated round trip, per input chunk."""
    n, gs = 29, 16
    spec = had(4, gs, intra_bits=8, error_feedback=True, residual_bits=32)  # fp32: exact
    x = rank_input(35, rank, W * n, torch.float32)
    for topo in (Topology(1, 4), Topology(2, 2)):
        ef = ErrorFeedback.for_spec(spec)
        out = torch.empty(n)
        quantized_reduce_scatter(out, x, spec=spec, error_feedback=ef, feedback_key="k", topology=topo, stats=stats)
        want = (x.view(W, n) - round_trip(x.view(W, n), gs, 8, gs, rows=W)).view(-1)
        assert torch.equal(ef.residual("k", W * n, x.device), want), topo
        plain = torch.empty(n)
        quantized_reduce_scatter(
            plain, x, spec=spec.replace(error_feedback=False, residual_bits=8), topology=topo, stats=stats
        )
        assert torch.equal(out, plain)  # the first call's residual is zero


def _world(rank: int, W: int) -> dict:
    stats = CommStats()
    _gathers(rank, W, Topology(2, 2), stats)
    _reduce_scatters(rank, W, stats)
    _stochastic_2x2(rank, W, stats)
    _error_feedback(rank, W, stats)
    # all-reduce (the DDP hook's collective) with both halves rotated: close to the exact mean
    t = rank_input(36, rank, 50, torch.float32)
    ref = torch.stack([rank_input(36, r, 50, torch.float32) for r in range(W)]).mean(0)
    quantized_all_reduce(t, spec=had(8, 16), gather_spec=had(8, 16), topology=Topology(2, 2), stats=stats)
    assert torch.allclose(t, ref, atol=float(ref.abs().max()) / 30)
    return {"ok": True}


def test_rotated_collectives_match_the_reference_composition() -> None:
    assert all(r["ok"] for r in run_world(_world, 4, timeout=180))
