"""Error feedback on every quantized hop of qgZ, residuals stored in 8 bits (LoCo), their state
for checkpoints, and the spec / state agreement checks.

References: the kernels composed by hand (the same quantize / dequantize_sum calls qgZ makes,
with every rank's residuals tracked for both hops), and the telescoping identity of error
feedback: over T calls the outputs add up to the exact sums minus the residuals left after the
last call, ``sum_t out_t[j] = sum_t sum_r x_t,r[j] - sum_r r1_r[j] - sum_a r2_a[row of j]``.

Here: the gloo-world checks of this topic; its other tiers' checks are in
``tests/unit/test_comm_feedback.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.comm_helpers import DTYPES, rank_input
from tests.worlds import run_world
from zeropp.comm import ErrorFeedback, QuantSpec, Topology
from zeropp.comm.feedback import HOP2_SUFFIX
from zeropp.kernels import QuantizedTensor, dequantize, dequantize_sum, quantize

GS = 16  # small groups: several scales per chunk even at awkward sizes


# ------------------------------------------------------------------ gloo worlds: both hops
def _reference(
    xs: list[list[torch.Tensor]], topo: Topology, n: int, bits: int, intra: int, gs: int, ef: bool
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """qgZ (SUM) over calls ``xs[t][rank]`` ([W * n] fp32) with fp32 error feedback on both hops,
    composed from the kernels in qgZ's order. Returns (outputs per rank after the last call,
    every rank's final hop-1 residual [W, n], every rank's final hop-2 residual [nodes, n])."""
    nodes, rpn, W = topo.nodes, topo.ranks_per_node, topo.world_size
    hier = nodes > 1 and rpn > 1
    r1 = [torch.zeros(W, n) for _ in range(W)]
    r2 = [torch.zeros(nodes, n) for _ in range(W)]
    outs: list[torch.Tensor] = []
    for call in xs:
        q1 = []
        for r in range(W):
            x = call[r].float().view(W, n) + (r1[r] if ef else 0)
            q = quantize(x, intra if hier or nodes == 1 else bits, gs, rows=W)
            q1.append(q)
            if ef:
                r1[r] = x - dequantize(q).view(W, n)
        if not hier:  # one all-to-all: rank j sums everyone's row j in rank order
            outs = [dequantize_sum(_rows(q1, list(range(W)), [j])).view(-1) for j in range(W)]
            continue
        q2 = {}
        for r in range(W):
            a, l = divmod(r, rpn)
            peers = [a * rpn + lp for lp in range(rpn)]
            p = dequantize_sum(_rows(q1, peers, [m * rpn + l for m in range(nodes)])).view(nodes, n)
            p = p + (r2[r] if ef else 0)
            q2[r] = quantize(p, bits, gs, rows=nodes)
            if ef:
                r2[r] = p - dequantize(q2[r]).view(nodes, n)
        outs = []
        for j in range(W):
            m, l = divmod(j, rpn)
            outs.append(dequantize_sum(_rows(q2, [a * rpn + l for a in range(nodes)], [m])).view(-1))
    return outs, r1, r2


def _rows(qs, sources: list[int], rows: list[int]) -> QuantizedTensor:
    """Stack rows ``rows`` of the quantized tensors of ``sources``: [len(sources), len(rows), *]."""
    q0 = qs[sources[0]]
    codes = torch.stack([qs[s].codes[rows] for s in sources])
    scales = torch.stack([qs[s].scales[rows] for s in sources])
    return QuantizedTensor(codes, scales, q0.cols, q0.bits, q0.group_size)


def _calls(seed: int, T: int, W: int, n: int, dtype: torch.dtype, constant: bool) -> list[list[torch.Tensor]]:
    if constant:  # the same gradient every call: without feedback the rounding error grows linearly
        return [[rank_input(seed, r, W * n, dtype) for r in range(W)]] * T
    return [[rank_input(seed + t, r, W * n, dtype) for r in range(W)] for t in range(T)]


def _exact_against_reference(rank: int, topo: Topology, stats) -> None:
    """Several calls at fp32 residuals: bit-exact with the hand-composed reference, both hops."""
    from zeropp.comm import quantized_reduce_scatter

    W = topo.world_size
    for n, dtype in (
        (1, torch.float32),
        (7, torch.float32),
        (37, torch.float32),
        (7, torch.bfloat16),
        (7, torch.float16),
    ):
        xs = _calls(60, 3, W, n, dtype, constant=False)
        spec = QuantSpec(bits=4, intra_bits=8, group_size=GS, error_feedback=True, residual_bits=32)
        ef = ErrorFeedback.for_spec(spec)
        out = torch.empty(n, dtype=dtype)
        for call in xs:
            quantized_reduce_scatter(
                out,
                call[rank],
                torch.distributed.ReduceOp.SUM,
                spec=spec,
                error_feedback=ef,
                feedback_key="b",
                topology=topo,
                stats=stats,
            )
        want, r1, r2 = _reference(xs, topo, n, 4, 8, GS, ef=True)
        assert torch.equal(out, want[rank].to(dtype)), (topo, n, dtype)
        assert torch.equal(ef.residual("b", W * n, out.device), r1[rank].view(-1)), (topo, n)
        hier = topo.nodes > 1 and topo.ranks_per_node > 1
        assert (("b" + HOP2_SUFFIX) in ef.keys()) == hier  # noqa: SIM118 (ErrorFeedback is not a mapping)
        if hier:
            got2 = ef.residual("b" + HOP2_SUFFIX, topo.nodes * n, out.device)
            assert torch.equal(got2, r2[rank].view(-1)), (topo, n)


def _accumulated_error(rank: int, topo: Topology, stats) -> dict:
    """Constant gradients over T calls: the telescoping identity holds (fp32 residuals), and the
    accumulated error with feedback on both hops is far below hop 1 only, itself below none."""
    from zeropp.comm import quantized_reduce_scatter

    W, nodes, rpn, T = topo.world_size, topo.nodes, topo.ranks_per_node, 8
    res: dict = {}
    for dname, dtype in DTYPES.items():
        for n in (7, 257):
            xs = _calls(70, T, W, n, dtype, constant=True)
            exact = sum(x.double() for x in xs[0]).view(W, n)[rank] * T  # [n]
            errs = {}
            for mode in ("none", "hop1", "both", "both8"):
                bits_r = 8 if mode == "both8" else 32
                spec = QuantSpec(
                    bits=4,
                    intra_bits=4,
                    group_size=GS,
                    error_feedback=mode != "none",
                    residual_bits=bits_r if mode != "none" else 8,
                )
                ef = ErrorFeedback.for_spec(spec) if mode != "none" else None
                out, acc = torch.empty(n, dtype=dtype), torch.zeros(n, dtype=torch.float64)
                for call in xs:
                    if mode == "hop1":
                        ef.reset("k" + HOP2_SUFFIX)
                    quantized_reduce_scatter(
                        out,
                        call[rank],
                        torch.distributed.ReduceOp.SUM,
                        spec=spec,
                        error_feedback=ef,
                        feedback_key="k",
                        topology=topo,
                        stats=stats,
                    )
                    acc += out.double()
                errs[mode] = float((acc - exact).abs().max())
                if mode == "both" and dtype == torch.float32:
                    # telescoping: sum of outputs = exact sum - what every rank still holds for my chunk
                    held = torch.zeros(n, dtype=torch.float64)
                    for r in range(W):  # every rank's final hop-1 residual of chunk `rank`
                        held += _final_residuals(xs, topo, n, r)[0][rank].double()
                    if nodes > 1 and rpn > 1:
                        m, l = divmod(rank, rpn)
                        for a in range(nodes):  # node a's re-quantization of my chunk (by rank a*rpn + l)
                            held += _final_residuals(xs, topo, n, a * rpn + l)[1][m].double()
                    slack = 1e-5 * float(exact.abs().max() + 1)
                    res.setdefault("telescoping", []).append(float((acc - (exact - held)).abs().max()) <= slack)
            res[(dname, n)] = errs
    return res


_FINAL_CACHE: dict = {}


def _final_residuals(xs, topo, n, r):
    key = (id(xs), n, str(topo))
    if key not in _FINAL_CACHE:
        _FINAL_CACHE.clear()
        _FINAL_CACHE[key] = _reference(xs, topo, n, 4, 4, GS, ef=True)
    _, r1, r2 = _FINAL_CACHE[key]
    return r1[r], r2[r]


def _plugins_use_both_hops(rank: int, topo: Topology, stats) -> dict:
    """The DDP hook's all-reduce and the FSDP2 reduce-scatter carry the hop-2 residual too."""
    from zeropp.comm import quantized_all_reduce
    from zeropp.comm.fsdp import QuantizedReduceScatter

    W, n = topo.world_size, 29
    spec = QuantSpec(bits=4, error_feedback=True)
    ef = ErrorFeedback.for_spec(spec)
    t = rank_input(80, rank, 2 * W * n - 3, torch.float32)  # padded inside
    quantized_all_reduce(t, spec=spec, error_feedback=ef, feedback_key="bucket0", topology=topo, stats=stats)
    rs = QuantizedReduceScatter(spec, topology=topo, stats=stats)
    out = torch.empty(n)
    rs(out, rank_input(81, rank, W * n, torch.float32), None, torch.distributed.ReduceOp.AVG)
    return {
        "ddp": sorted(ef.keys()),
        "fsdp": sorted(rs.error_feedback.keys()),
        "fsdp_bits": rs.error_feedback.residual_bits,
    }


def _hadamard_both_hops(rank: int, topo: Topology, stats) -> dict:
    """A Hadamard spec keeps its hop-2 residual in the rotated basis ([nodes, rotated n]) and
    still bounds the accumulated error (constant gradients, 8 calls)."""
    from zeropp.comm import quantized_reduce_scatter
    from zeropp.kernels import rotated_cols

    W, n, T = topo.world_size, 37, 8
    xs = _calls(90, T, W, n, torch.float32, constant=True)
    exact = sum(x.double() for x in xs[0]).view(W, n)[rank] * T
    errs = {}
    for ef_on in (False, True):
        spec = QuantSpec(bits=4, group_size=GS, rotation="hadamard", error_feedback=ef_on)
        ef = ErrorFeedback.for_spec(spec) if ef_on else None
        out, acc = torch.empty(n), torch.zeros(n, dtype=torch.float64)
        for call in xs:
            quantized_reduce_scatter(
                out,
                call[rank],
                torch.distributed.ReduceOp.SUM,
                spec=spec,
                error_feedback=ef,
                feedback_key="h",
                topology=topo,
                stats=stats,
            )
            acc += out.double()
        errs[ef_on] = float((acc - exact).abs().max())
    ef.residual("h" + HOP2_SUFFIX, topo.nodes * rotated_cols(n, GS), out.device)  # raises on another layout
    return errs


def _world(rank: int, W: int) -> dict:
    from zeropp.comm import CommStats

    stats = CommStats()
    out = {}
    for name, topo in (("2x2", Topology(2, 2)), ("1x4", Topology(1, 4)), ("4x1", Topology(4, 1))):
        _exact_against_reference(rank, topo, stats)
        if name != "4x1":
            out[name] = _accumulated_error(rank, topo, stats)
    out["plugins"] = _plugins_use_both_hops(rank, Topology(2, 2), stats)
    out["hadamard"] = _hadamard_both_hops(rank, Topology(2, 2), stats)
    return out


@pytest.fixture(scope="module")
def world() -> list[dict]:
    return run_world(_world, 4, timeout=300)


def test_feedback_on_both_hops_is_exact_against_the_reference(world) -> None:
    assert len(world) == 4  # each rank asserted bit-exactness (outputs and both residuals) itself


@pytest.mark.parametrize("topo", ["2x2", "1x4"])
def test_feedback_bounds_the_accumulated_error(world, topo: str) -> None:
    for rank, res in enumerate(world):
        r = res[topo]
        assert all(r["telescoping"]), (rank, topo)
        for key, errs in r.items():
            if key == "telescoping":
                continue
            # without feedback a constant gradient's rounding error adds up over the 8 calls
            assert errs["both"] < errs["none"] / 3, (rank, topo, key, errs)
            assert errs["both8"] < errs["none"] / 3, (rank, topo, key, errs)
            if topo == "2x2":  # compensating hop 2 too beats hop 1 alone
                assert errs["both"] < errs["hop1"], (rank, topo, key, errs)


def test_plugins_keep_residuals_of_both_hops(world) -> None:
    for res in world:
        p = res["plugins"]
        assert p["ddp"] == ["bucket0", "bucket0" + HOP2_SUFFIX]
        assert len(p["fsdp"]) == 2 and p["fsdp"][1] == p["fsdp"][0] + HOP2_SUFFIX and p["fsdp_bits"] == 8


def test_hadamard_feedback_bounds_the_accumulated_error(world) -> None:
    for res in world:
        errs = res["hadamard"]
        assert errs[True] < errs[False] / 3, errs
