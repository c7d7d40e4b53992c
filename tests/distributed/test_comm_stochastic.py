"""Stochastic rounding through the quantized collectives (``QuantSpec(rounding="stochastic")``, seed rule of
``zeropp.comm.stochastic``): the collectives use exactly the documented kernel seed per
(seed, global rank, call index, hop); the result is unbiased where round-to-nearest has a fixed
bias; noise differs across calls and ranks and replays after resetting the call counter.

One 2-rank world (single-hop paths) and one 2x2 world (hierarchical qgZ, whose re-quantization
is hop 1). Everything is seeded, so every assertion is deterministic.

Here: the gloo-world checks of this topic; its other tiers' checks are in
``tests/unit/test_comm_stochastic.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.comm_helpers import CHECK_CALLS_ENV, rank_input
from tests.kernel_helpers import stack
from tests.stochastic_specs import SEED, sr_spec
from tests.worlds import run_world
from zeropp.comm import (
    CommStats,
    Topology,
    default_session,
    quantized_all_gather,
    quantized_all_reduce,
    quantized_reduce_scatter,
    reset_stochastic_calls,
    stochastic_calls,
    stochastic_seed,
)
from zeropp.comm.qgz import swizzle
from zeropp.comm.spec import QuantSpec
from zeropp.kernels import dequantize, dequantize_sum, dequantize_sum_requantize, quantize

CALLS = 50  # calls averaged in the unbiasedness checks


def _crafted(n: int, gs: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks whose absmax is 1 (scale = 1 / qmax) and whose other values sit 0.4 of a step above
    a grid point, so round-to-nearest always rounds them down. Returns (x, mask of those values)."""
    step = 1.0 / (2 ** (bits - 1) - 1)
    k = torch.arange(n) % 3  # grid points 0, 1, 2 (times the step)
    x = (k + 0.4) * step
    first = torch.arange(n) % gs == 0
    x[first] = 1.0
    return x, ~first


def _gather_exact(rank, W, topo, stats):
    """(a) the all-gather equals dequantize(quantize(shard, stochastic, documented seed)), per rank."""
    n = 300
    xs = [rank_input(7, r, n, torch.float32) for r in range(W)]
    for bits in (8, 4):
        call = stochastic_calls()
        out = torch.empty(W * n)
        quantized_all_gather(out, xs[rank], spec=sr_spec(bits, 128), topology=topo, stats=stats)
        assert stochastic_calls() == call + 1
        want = torch.cat(
            [
                dequantize(quantize(xs[r], bits, 128, stochastic=True, seed=stochastic_seed(SEED, r, call))).view(-1)
                for r in range(W)
            ]
        )
        assert torch.equal(out, want), bits
        nearest = torch.cat([dequantize(quantize(xs[r], bits, 128)).view(-1) for r in range(W)])
        assert not torch.equal(out, nearest)


def _reduce_scatter_exact(rank, W, topo, stats):
    """(a) single-hop qgZ: each rank quantizes its [W, n] rows with its own seed; chunk j summed."""
    n = 200
    xs = [rank_input(9, r, W * n, torch.float32) for r in range(W)]
    call = stochastic_calls()
    out = torch.empty(n)
    quantized_reduce_scatter(out, xs[rank], spec=sr_spec(4), topology=topo, stats=stats)
    qs = [
        quantize(xs[r].view(W, n), 4, 128, rows=W, stochastic=True, seed=stochastic_seed(SEED, r, call, 0))
        for r in range(W)
    ]
    acc = torch.zeros(n)
    for q in qs:
        acc = acc + dequantize(q)[rank]
    assert torch.equal(out, acc * (1.0 / W))


def _unbiased(rank, W, topo, stats):
    """(b) averages over CALLS stochastic calls converge; nearest keeps a fixed -0.4 step bias."""
    res = {}
    for name, bits, gs in (("all_gather", 8, 128), ("reduce_scatter", 4, 128)):
        step = 1.0 / (2 ** (bits - 1) - 1)
        n = 256
        if name == "all_gather":
            x, mask = _crafted(n, gs, bits)  # same shard on every rank
            exact, m = x.repeat(W), mask.repeat(W)

            def call(stochastic, x=x, bits=bits, n=n, gs=gs):
                out = torch.empty(W * n)
                quantized_all_gather(out, x, spec=sr_spec(bits, gs, stochastic=stochastic), topology=topo, stats=stats)
                return out
        else:
            x, mask = _crafted(W * n, gs, bits)  # every rank sends the same [W, n]: AVG = x's chunk
            exact, m = x.view(W, n)[rank], mask.view(W, n)[rank]

            def call(stochastic, x=x, bits=bits, n=n, gs=gs):
                out = torch.empty(n)
                quantized_reduce_scatter(
                    out, x, spec=sr_spec(bits, gs, stochastic=stochastic), topology=topo, stats=stats
                )
                return out

        nearest = [call(False) for _ in range(3)]
        assert all(torch.equal(a, nearest[0]) for a in nearest), "round-to-nearest is deterministic"
        bias = (nearest[0] - exact)[m] / step
        assert torch.allclose(bias, torch.full_like(bias, -0.4), atol=1e-3), name  # always rounds down

        runs = torch.stack([call(True) for _ in range(CALLS)])  # [CALLS, numel]
        err_one = (runs[0] - exact)[m] / step
        err_avg = (runs.mean(0) - exact)[m] / step
        res[name] = (float(err_one.pow(2).mean().sqrt()), float(err_avg.pow(2).mean().sqrt()), float(err_avg.mean()))
        rms_one, rms_avg, mean_avg = res[name]
        assert rms_avg < 0.3 * rms_one, (name, res[name])  # ~1/sqrt(CALLS) of a single call's error
        assert abs(mean_avg) < 0.05, (name, res[name])  # no systematic bias (nearest: -0.4)
        assert (runs[0] - exact)[m].abs().max() <= step * (1 + 1e-4)  # still within one step per element
    return res


def _noise_differs(rank, W, topo, stats):
    """(c) successive calls and different ranks draw different noise; resetting the counter replays."""
    n = 512
    x = rank_input(3, 0, n, torch.float32)  # the same shard on every rank
    start = stochastic_calls()
    outs = []
    for _ in range(2):
        out = torch.empty(W * n)
        quantized_all_gather(out, x, spec=sr_spec(4, 64), topology=topo, stats=stats)
        outs.append(out)
    assert not torch.equal(outs[0], outs[1]), "two calls must draw different noise"
    halves = outs[0].view(W, n)
    assert not torch.equal(halves[0], halves[1]), "two ranks must draw different noise"
    other = torch.empty(W * n)
    quantized_all_gather(other, x, spec=sr_spec(4, 64, seed=SEED + 1), topology=topo, stats=stats)
    assert not torch.equal(other, outs[0])  # a different base seed: different noise
    reset_stochastic_calls(start)
    again = torch.empty(W * n)
    quantized_all_gather(again, x, spec=sr_spec(4, 64), topology=topo, stats=stats)
    assert torch.equal(again, outs[0]), "same (seed, rank, call) must replay"
    # plain collectives (spec=None) and rounding="nearest" take no call index
    before = stochastic_calls()
    quantized_all_gather(torch.empty(W * n), x, spec=None, topology=topo, stats=stats)
    quantized_all_gather(torch.empty(W * n), x, spec=QuantSpec(bits=8), topology=topo, stats=stats)
    assert stochastic_calls() == before
    # all-reduce: both quantized halves take one index each
    t = x.clone()
    quantized_all_reduce(t, spec=sr_spec(8), gather_spec=sr_spec(8), topology=topo, stats=stats)
    assert stochastic_calls() == before + 2 and torch.allclose(t, x, atol=float(x.abs().max()) / 50)


def _bad_seed(rank, W, topo, stats):
    for bad in (-1, 2**63, 1.5):
        with pytest.raises(ValueError, match=r"\[0, 2\*\*63\)"):
            quantized_all_gather(
                torch.empty(W * 4), torch.ones(4), spec=sr_spec(8, seed=bad), topology=topo, stats=stats
            )
        with pytest.raises(ValueError, match=r"\[0, 2\*\*63\)"):
            quantized_reduce_scatter(
                torch.empty(4), torch.ones(W * 4), spec=sr_spec(4, seed=bad), topology=topo, stats=stats
            )


def _plugins(rank, W, topo, stats):
    """The FSDP2 plug-ins pass the spec's rounding/seed through, drawing the index from their own
    session's counter: same result as the direct (default-session) call at that index."""
    from zeropp.comm import CommSession
    from zeropp.comm.fsdp import QuantizedAllGather, QuantizedReduceScatter

    x = rank_input(5, rank, 2 * W * 64, torch.float32)
    session = CommSession(topo, stats=stats)
    session.stochastic.reset(3)  # not where the default counter is
    for plug, direct, out_n in (
        (
            lambda o: QuantizedAllGather(sr_spec(8, 128), session=session)(o, x[:128], None),
            lambda o: quantized_all_gather(o, x[:128], spec=sr_spec(8, 128), topology=topo, stats=stats),
            W * 128,
        ),
        (
            lambda o: QuantizedReduceScatter(sr_spec(4), session=session)(o, x, None, torch.distributed.ReduceOp.AVG),
            lambda o: quantized_reduce_scatter(o, x, spec=sr_spec(4), topology=topo, stats=stats),
            x.numel() // W,
        ),
    ):
        start, default = session.stochastic.value, stochastic_calls()
        a, b = torch.empty(out_n), torch.empty(out_n)
        plug(a)
        assert session.stochastic.value == start + 1 and stochastic_calls() == default  # the plug-in's own counter
        reset_stochastic_calls(start)
        direct(b)
        assert torch.equal(a, b) and stochastic_calls() == start + 1


def _world2(rank, W):
    topo, stats = Topology(nodes=1, ranks_per_node=W), CommStats()
    reset_stochastic_calls()
    _gather_exact(rank, W, topo, stats)
    _reduce_scatter_exact(rank, W, topo, stats)
    _noise_differs(rank, W, topo, stats)
    _bad_seed(rank, W, topo, stats)
    _plugins(rank, W, topo, stats)
    return _unbiased(rank, W, topo, stats)


def _world_2x2(rank, W):
    """Hierarchical qgZ: intra hop seeded (seed, r, call, 0), the node re-quantization (seed, r, call, 1)."""
    topo, stats = Topology(nodes=2, ranks_per_node=2), CommStats()
    nodes, rpn, n, gs, ib, b = 2, 2, 150, 64, 8, 4
    assert default_session().check_collectives  # launched with CHECK_CALLS_ENV: the check takes no call index
    reset_stochastic_calls(5)
    xs = [rank_input(11, r, W * n, torch.float32) for r in range(W)]
    out = torch.empty(n)
    quantized_reduce_scatter(out, xs[rank], spec=sr_spec(b, gs, intra_bits=ib), topology=topo, stats=stats)
    first = [
        quantize(
            swizzle(xs[r].view(W, n), nodes, rpn), ib, gs, rows=W, stochastic=True, seed=stochastic_seed(SEED, r, 5, 0)
        )
        for r in range(W)
    ]  # rows l*nodes + m -> local peer l
    node, local = divmod(rank, rpn)
    sums = []
    for a in range(nodes):  # rank (a, local) re-quantizes the sums of its node for my local index
        src = [first[a * rpn + lp] for lp in range(rpn)]
        pieces = stack(
            [
                type(q)(
                    q.codes[local * nodes : (local + 1) * nodes],
                    q.scales[local * nodes : (local + 1) * nodes],
                    q.cols,
                    q.bits,
                    q.group_size,
                )
                for q in src
            ]
        )
        q2 = dequantize_sum_requantize(
            pieces, b, gs, stochastic=True, seed=stochastic_seed(SEED, a * rpn + local, 5, 1)
        )
        sums.append(type(q2)(q2.codes[node : node + 1], q2.scales[node : node + 1], q2.cols, q2.bits, q2.group_size))
    want = dequantize_sum(stack(sums)).view(-1) * (1.0 / W)
    assert torch.equal(out, want)
    # unbiased through both hops: crafted input, same on every rank
    x, mask = _crafted(W * n, gs, ib)
    exact, m = x.view(W, n)[rank], mask.view(W, n)[rank]
    outs = []
    for _ in range(CALLS):
        o = torch.empty(n)
        quantized_reduce_scatter(o, x, spec=sr_spec(b, gs, intra_bits=ib), topology=topo, stats=stats)
        outs.append(o)
    near = torch.empty(n)
    quantized_reduce_scatter(near, x, spec=sr_spec(b, gs, intra_bits=ib, stochastic=False), topology=topo, stats=stats)
    runs = torch.stack(outs)
    step4 = 1.0 / 7  # the 4-bit cross hop dominates the error
    rms_one = float(((runs[0] - exact)[m] / step4).pow(2).mean().sqrt())
    rms_avg = float(((runs.mean(0) - exact)[m] / step4).pow(2).mean().sqrt())
    bias_near = float(((near - exact)[m] / step4).mean())
    bias_avg = float(((runs.mean(0) - exact)[m] / step4).mean())
    assert rms_avg < 0.3 * rms_one and abs(bias_avg) < 0.05 < abs(bias_near), (rms_one, rms_avg, bias_avg, bias_near)
    return rms_one, rms_avg, bias_avg, bias_near


def test_stochastic_collectives_on_two_ranks():
    res = run_world(_world2, 2, timeout=120)
    assert res[0].keys() == {"all_gather", "reduce_scatter"}


def test_stochastic_hierarchical_qgz():
    run_world(_world_2x2, 4, timeout=120, env=CHECK_CALLS_ENV)
