"""qwZ all-gather and qgZ reduce-scatter on gloo worlds of every shape, against torch.distributed;
byte accounting against the analytic volumes (ZeRO-3 vs ZeRO++, background.md section 2); bad
arguments raising the same clear error on every rank instead of hanging.

One world launch per topology runs every check (a launch costs seconds on 2 cores). Each rank
regenerates every rank's input, so it checks its own result three ways: bit-exact against the
algorithm simulated with the kernels' reference (routing/swizzle), within the scale-derived
quantization bound of the exact reduction (the math), and bit-exact against the plain
torch.distributed collective when quantization is off. Byte counts must equal the formulas.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.comm_helpers import (
    CHECK_CALLS_ENV,
    DTYPES,
    REL_ROUND,
    block_absmax,
    bytes_of,
    expected_all_gather_bytes,
    expected_reduce_scatter_bytes,
    qgz_error_bound,
    qmax,
    rank_input,
    simulate_qgz,
    spec_of,
    wire,
)
from tests.worlds import run_world
from zeropp.comm import (
    CommStats,
    ErrorFeedback,
    ReduceOp,
    Topology,
    all_reduce,
    default_session,
    get_comm_stats,
    quantized_all_gather,
    quantized_reduce_scatter,
    set_topology,
)
from zeropp.comm.codecs import codec_for
from zeropp.comm.feedback import HOP2_SUFFIX
from zeropp.comm.spec import QuantSpec
from zeropp.kernels import dequantize, quantize

SIZES = (1, 7, 257)  # elements per shard / chunk: odd, smaller and larger than a block
BITS = (None, 8, 4)


def _check_all_gather(rank: int, topo: Topology, stats: CommStats) -> int:
    W, gs, checks = topo.world_size, 512, 0
    for dname, dtype in DTYPES.items():
        for n in SIZES:
            xs = [rank_input(1, r, n, dtype) for r in range(W)]
            for bits in BITS:
                out = torch.empty(W * n, dtype=dtype)
                stats.reset()
                quantized_all_gather(out, xs[rank], spec=spec_of(bits), topology=topo, stats=stats)
                got, want = (
                    bytes_of(stats, "all_gather"),
                    expected_all_gather_bytes(topo, n, out.element_size(), bits, gs),
                )
                assert got == want, f"all-gather bytes {got} != formula {want} ({dname}, n={n}, bits={bits})"
                if bits is None:
                    ref = torch.empty_like(out)
                    dist.all_gather_single(ref, xs[rank])
                    assert torch.equal(out, ref), f"plain all-gather differs ({dname}, n={n})"
                else:
                    # bit-exact: every shard went through quantize -> dequantize once
                    exp = torch.cat([dequantize(quantize(x, bits, gs), dtype=dtype).view(-1) for x in xs])
                    assert torch.equal(out, exp), (
                        f"qwZ all-gather != dequantize(quantize(shard)) ({dname}, n={n}, bits={bits})"
                    )
                    true = torch.cat(xs).float()
                    A = torch.cat([block_absmax(x.view(1, -1), gs).view(-1) for x in xs])
                    bound = A / (2 * qmax(bits)) * (1 + 1e-5) + true.abs() * REL_ROUND[dtype] * 2
                    assert ((out.float() - true).abs() <= bound).all(), f"qwZ error above bound ({dname}, n={n})"
                checks += 1
    # input aliasing the output (FSDP2 passes a view into the output buffer), async, fp32 output
    n = 7
    xs = [rank_input(2, r, n, torch.bfloat16) for r in range(W)]
    for bits in BITS:
        plain_out = torch.empty(W * n, dtype=torch.bfloat16)
        quantized_all_gather(plain_out, xs[rank], spec=spec_of(bits), topology=topo, stats=stats)
        buf = torch.zeros(W * n, dtype=torch.bfloat16)
        buf[rank * n : (rank + 1) * n] = xs[rank]
        h = quantized_all_gather(
            buf, buf[rank * n : (rank + 1) * n], spec=spec_of(bits), topology=topo, stats=stats, async_op=True
        )
        assert isinstance(h, dist.Work) and not h.is_completed()
        h.wait()
        assert h.is_completed() and torch.equal(buf, plain_out), f"aliased async all-gather differs (bits={bits})"
        wide = torch.empty(W * n, dtype=torch.float32)
        quantized_all_gather(wide, xs[rank], spec=spec_of(bits), topology=topo, stats=stats)
        exp = torch.cat([x.float() if bits is None else dequantize(quantize(x, bits, 512)).view(-1) for x in xs])
        assert torch.equal(wide, exp), f"fp32 output of a bf16 all-gather differs (bits={bits})"
        checks += 1
    # wire_out keeps the gathered wire rows: each member's encoding, which dequantizes to the output
    codec, spec = codec_for(QuantSpec(bits=8)), QuantSpec(bits=8)
    rows = torch.full((W * codec.wire_bytes(n, 8, 512),), 7, dtype=torch.uint8)
    kept = torch.empty(W * n, dtype=torch.bfloat16)
    quantized_all_gather(kept, xs[rank], spec=spec, topology=topo, stats=stats, async_op=True, wire_out=rows).wait()
    for r, x in enumerate(xs):
        assert torch.equal(rows.view(W, -1)[r], codec.encode(x.view(-1), 8, 512, rows=1, seed=None).view(-1)), r
    assert torch.equal(kept, torch.cat([dequantize(quantize(x, 8, 512), dtype=torch.bfloat16).view(-1) for x in xs]))
    again = torch.empty(W * n, dtype=torch.bfloat16)
    codec.dequantize(codec.unpack(rows.view(W, -1), n, 8, 512), out=again.view(W, n))
    assert torch.equal(again, kept), "the kept rows dequantize to another output"
    return checks + 1


def _rs_reference(inputs, rank, n, dtype, op_name, W):
    """Exact fp64 reduction of chunk ``rank`` over all ranks."""
    s = torch.stack([x.view(W, n)[rank].double() for x in inputs]).sum(0)
    return s / W if op_name == "avg" else (s * 0.5 if op_name == "premul" else s)


def _check_reduce_scatter(rank: int, topo: Topology, stats: CommStats) -> int:
    W, gs, checks = topo.world_size, 128, 0
    ops = {"avg": ReduceOp.AVG, "sum": ReduceOp.SUM, "premul": ReduceOp.PREMUL_SUM(0.5)}
    post = {"avg": 1.0 / W, "sum": 1.0, "premul": 0.5}
    combos = [(d, n, b, ib) for d in DTYPES for n in SIZES for (b, ib) in ((None, None), (8, 8), (4, 4))]
    # ops alternate: every 6 consecutive combos cover each (bits, op) pair
    cases = [(d, n, b, ib, ("avg", "sum")[i % 2]) for i, (d, n, b, ib) in enumerate(combos)]
    cases += [("bf16", 257, 4, 8, "avg"), ("fp32", 7, 4, 8, "premul"), ("fp32", 7, None, None, "premul")]
    for dname, n, bits, ibits, op_name in cases:
        dtype = DTYPES[dname]
        xs = [rank_input(3 + n, r, W * n, dtype) for r in range(W)]
        out = torch.empty(n, dtype=dtype)
        stats.reset()
        quantized_reduce_scatter(out, xs[rank], ops[op_name], spec=spec_of(bits, ibits), topology=topo, stats=stats)
        what = f"({dname}, n={n}, bits={bits}/{ibits}, {op_name})"
        got, want = (
            bytes_of(stats, "reduce_scatter"),
            expected_reduce_scatter_bytes(topo, n, out.element_size(), bits, ibits, gs),
        )
        assert got == want, f"reduce-scatter bytes {got} != formula {want} {what}"
        exact = _rs_reference(xs, rank, n, dtype, op_name, W)
        if bits is None:
            ref = torch.empty_like(out)
            src = xs[rank] * 0.5 if op_name == "premul" else xs[rank]
            if op_name == "avg" and dtype == torch.float32:  # the backend's own reduce-scatter
                dist.reduce_scatter_single(ref, src, op=ops[op_name])
            elif op_name == "avg":  # half precision: summed in fp32, divided, rounded once
                mine = [x.view(W, n)[rank] for x in xs]
                ref.copy_(torch.stack(mine).float().sum(0).div_(W))
            else:  # gloo sums: an all-to-all, then this rank's chunks summed in rank order
                srcs = [x * 0.5 if op_name == "premul" else x for x in xs]
                mine = [x.view(W, n)[rank] for x in srcs]
                if dtype == torch.float32:  # one rounded addition at a time, rank 0 first
                    ref.copy_(mine[0])
                    for x in mine[1:]:
                        ref += x
                else:  # half precision: accumulated in fp32, rounded once
                    torch.sum(torch.stack(mine), 0, out=ref)
            assert torch.equal(out, ref), f"plain reduce-scatter differs from its reference {what}"
            # ... and is the true reduction: equality with the backend alone would pass a backend whose
            # AVG sums (the gloo bug background.md section 5 mentions). W roundings in the dtype at most.
            mass = torch.stack([x.view(W, n)[rank].double().abs() for x in xs]).sum(0) * post[op_name]
            assert ((out.double() - exact).abs() <= mass * REL_ROUND[dtype] * 2 * W + 1e-30).all(), (
                f"plain result is not the true {op_name} {what}"
            )
        else:
            sim = simulate_qgz(xs, topo, rank, n, bits, ibits, gs).mul(post[op_name]).to(dtype)
            assert torch.equal(out, sim), f"qgZ result is not the simulated hierarchical sum {what}"
            bound = qgz_error_bound(xs, topo, rank, n, bits, ibits, gs).double() * post[op_name]
            bound = bound + exact.abs() * REL_ROUND[dtype] * 2 + 1e-30
            err = (out.double() - exact).abs()
            assert (err <= bound).all(), f"qgZ error {err.max():.3g} above bound {what}"
        checks += 1
    return checks


EF4 = QuantSpec(bits=4, error_feedback=True, residual_bits=32)  # fp32 residuals: exact checks


def _check_reduce_scatter_extras(rank: int, topo: Topology, stats: CommStats) -> None:
    W, n, gs = topo.world_size, 9, 128
    xs = [rank_input(50, r, W * n, torch.float32) for r in range(W)]
    # async: the handle finishes the later hop in wait()
    sync_out, async_out = torch.empty(n), torch.empty(n)
    quantized_reduce_scatter(sync_out, xs[rank], spec=QuantSpec(bits=4), topology=topo, stats=stats)
    h = quantized_reduce_scatter(async_out, xs[rank], spec=QuantSpec(bits=4), topology=topo, stats=stats, async_op=True)
    assert isinstance(h, dist.Work)
    h.wait()
    assert torch.equal(sync_out, async_out)
    # error feedback: 1st call stores r = x - deq(quant(x)); the 2nd call quantizes x2 + r
    ef = ErrorFeedback.for_spec(EF4)
    out1, out2 = torch.empty(n), torch.empty(n)
    quantized_reduce_scatter(
        out1, xs[rank], ReduceOp.SUM, spec=EF4, topology=topo, error_feedback=ef, feedback_key="b0", stats=stats
    )
    assert torch.equal(out1, simulate_qgz(xs, topo, rank, n, 4, 4, gs)), "error feedback changed the first call"
    res = [x.view(W, n) - dequantize(quantize(x.view(W, n), 4, gs, rows=W)) for x in xs]
    assert torch.equal(ef.residual("b0", W * n, torch.device("cpu")), res[rank].view(-1))
    x2 = [rank_input(51, r, W * n, torch.float32) for r in range(W)]
    ef.reset("b0" + HOP2_SUFFIX)  # hop 1 only here; tests/distributed/test_comm_feedback.py checks both hops
    quantized_reduce_scatter(
        out2, x2[rank], ReduceOp.SUM, spec=EF4, topology=topo, error_feedback=ef, feedback_key="b0", stats=stats
    )
    comp = [x2[r] + res[r].view(-1) for r in range(W)]
    assert torch.equal(out2, simulate_qgz(comp, topo, rank, n, 4, 4, gs)), "residual not added to the next gradient"


def _zero3_vs_zeropp(rank: int, topo: Topology) -> dict:
    """ZeRO-3 vs ZeRO++ bytes of one layer (background.md section 2), each equal to its formula."""
    groups = topo.build()
    nodes, rpn, W, bf16 = topo.nodes, topo.ranks_per_node, topo.world_size, torch.bfloat16
    M = W * 1024  # model elements; bf16, so the model is 2M bytes
    shard = rank_input(7, rank, M // W, bf16)
    grad = rank_input(8, rank, M, bf16)
    full, gshard = torch.empty(M, dtype=bf16), torch.empty(M // W, dtype=bf16)

    z3 = CommStats()  # ZeRO-3: plain fwd all-gather, plain bwd all-gather, plain reduce-scatter
    quantized_all_gather(full, shard, spec=None, topology=topo, stats=z3, kind="fwd_ag")
    quantized_all_gather(full, shard, spec=None, topology=topo, stats=z3, kind="bwd_ag")
    quantized_reduce_scatter(gshard, grad, spec=None, topology=topo, stats=z3, kind="rs")

    zpp = CommStats()  # ZeRO++: qwZ INT8 over the world, hpZ plain inside the node, qgZ INT4
    quantized_all_gather(full, shard, spec=QuantSpec(bits=8), topology=topo, stats=zpp, kind="fwd_ag")
    secondary = full.view(rpn, M // rpn)[topo.local_rank(rank)].clone()  # hpZ secondary shard
    quantized_all_gather(full, secondary, groups.hpz, spec=None, topology=topo, stats=zpp, kind="bwd_ag")
    quantized_reduce_scatter(gshard, grad, spec=QuantSpec(bits=4), topology=topo, stats=zpp, kind="rs")

    cross_frac = (W - rpn) / W  # share of the other ranks that sit on other nodes
    model_bytes = 2 * M
    assert z3.total(link="cross") == 3 * model_bytes * (W - rpn) // W  # "3M", its cross-node part
    for kind in ("fwd_ag", "bwd_ag", "rs"):
        assert bytes_of(z3, kind)["cross"] == model_bytes * cross_frac
    n = M // W
    assert bytes_of(zpp, "fwd_ag") == {"intra": (rpn - 1) * wire(n, 8, 512), "cross": (W - rpn) * wire(n, 8, 512)}
    assert bytes_of(zpp, "bwd_ag") == {"intra": (rpn - 1) * (M // rpn) * 2, "cross": 0}
    assert bytes_of(zpp, "rs") == {"intra": (rpn - 1) * nodes * wire(n, 4, 128), "cross": (nodes - 1) * wire(n, 4, 128)}

    # plain all-reduce (stage 0): reduce-scatter + all-gather volume, 2 * nbytes / W per peer
    ar = CommStats()
    t = grad.float()
    ref = t.clone()
    all_reduce(t, topology=topo, stats=ar)
    dist.all_reduce(ref)
    assert torch.equal(t, ref)
    assert bytes_of(ar, "all_reduce") == {"intra": (rpn - 1) * 2 * M * 4 // W, "cross": (W - rpn) * 2 * M * 4 // W}
    # a smaller hpZ group (MiCS-like): consecutive ranks inside the node
    sub = Topology(nodes, rpn, hpz_size=rpn // 2)
    assert dist.get_process_group_ranks(sub.build().hpz) == sub.hpz_ranks(rank)
    assert len(sub.hpz_ranks(rank)) == rpn // 2 and all(sub.same_node(rank, p) for p in sub.hpz_ranks(rank))
    return {"zero3_cross": z3.total(link="cross"), "zeropp_cross": zpp.total(link="cross")}


def _bad_calls(rank: int, world: int, topo: Topology) -> dict:
    """Each bad call must raise on every rank before any message is sent."""
    n = 5
    x, out, big = torch.randn(n), torch.empty(n), torch.randn(world * n)
    q4, q8 = QuantSpec(bits=4), QuantSpec(bits=8)
    cases = {
        "all-gather output of the wrong size": lambda: quantized_all_gather(
            torch.empty(world * n + 1), x, spec=q8, topology=topo
        ),
        "reduce-scatter input of the wrong size": lambda: quantized_reduce_scatter(
            out, big[:-1], spec=q4, topology=topo
        ),
        "reduce-scatter output of the wrong size (plain)": lambda: quantized_reduce_scatter(
            torch.empty(n + 1), big, spec=None, topology=topo
        ),
        "unsupported bits": lambda: quantized_reduce_scatter(out, big, spec=QuantSpec(bits=3), topology=topo),
        "unsupported intra_bits": lambda: quantized_reduce_scatter(
            out, big, spec=QuantSpec(bits=4, intra_bits=2), topology=topo
        ),
        "unsupported all-gather bits": lambda: quantized_all_gather(
            torch.empty(world * n), x, spec=QuantSpec(bits=6), topology=topo
        ),
        "topology of another world": lambda: quantized_reduce_scatter(out, big, spec=q4, topology=Topology(2, 4)),
        "odd group size for INT4": lambda: quantized_reduce_scatter(
            out, big, spec=QuantSpec(bits=4, group_size=7), topology=topo
        ),
        "integer input to a quantized gather": lambda: quantized_all_gather(
            torch.empty(world * n, dtype=torch.int32), torch.ones(n, dtype=torch.int32), spec=q8, topology=topo
        ),
        "MAX with quantization": lambda: quantized_reduce_scatter(out, big, ReduceOp.MAX, spec=q4, topology=topo),
        "non-contiguous output": lambda: quantized_all_gather(
            torch.empty(2 * world * n)[::2], x, spec=q8, topology=topo
        ),
        "error feedback of another size": lambda: _ef_mismatch(out, big, topo),
        # a plain value on one side of bits/intra_bits used to be dropped silently: 16 ran a
        # 4-bit intra-node hop, and intra_bits=8 with bits=None a plain reduce-scatter
        "unquantized intra hop under a quantized cross hop": lambda: quantized_reduce_scatter(
            out, big, spec=QuantSpec(bits=4, intra_bits=16), topology=topo
        ),
        "intra_bits without bits": lambda: quantized_reduce_scatter(
            out, big, spec=QuantSpec(bits=None, intra_bits=8), topology=topo
        ),
        # the spec and the error-feedback state must agree; one-hop gathers refuse per-hop settings
        "error feedback spec without state": lambda: quantized_reduce_scatter(out, big, spec=EF4, topology=topo),
        "error feedback state without spec flag": lambda: quantized_reduce_scatter(
            out, big, spec=q4, error_feedback=ErrorFeedback(), topology=topo
        ),
        "error feedback state on a plain reduce-scatter": lambda: quantized_reduce_scatter(
            out, big, spec=None, error_feedback=ErrorFeedback(), topology=topo
        ),
        "all-gather with intra_bits": lambda: quantized_all_gather(
            torch.empty(world * n), x, spec=QuantSpec(bits=4, intra_bits=8), topology=topo
        ),
        "all-gather with error feedback": lambda: quantized_all_gather(
            torch.empty(world * n), x, spec=EF4, topology=topo
        ),
        "spec of the wrong type": lambda: quantized_all_gather(torch.empty(world * n), x, spec=8, topology=topo),
        "wire_out of the wrong size": lambda: quantized_all_gather(
            torch.empty(world * n), x, spec=q8, topology=topo, wire_out=torch.empty(3, dtype=torch.uint8)
        ),
        "wire_out without a spec": lambda: quantized_all_gather(
            torch.empty(world * n), x, topology=topo, wire_out=torch.empty(3, dtype=torch.uint8)
        ),
    }
    msgs = {}
    for name, fn in cases.items():
        try:
            fn()
            msgs[name] = None
        except (ValueError, TypeError) as e:
            msgs[name] = f"{type(e).__name__}: {e}"
    try:  # a wrong process-wide default is caught the same way, where it is set (library_misuse)
        set_topology(Topology(1, 8))
        quantized_all_gather(torch.empty(world * n), x, spec=q8)
        msgs["default topology of another world"] = None
    except ValueError as e:
        msgs["default topology of another world"] = f"ValueError: {e}"
    finally:
        set_topology(None)
    # nobody is stuck half-way through a collective: a good call still works on every rank
    good = torch.empty(world * n)
    quantized_all_gather(good, torch.full((n,), float(rank)), spec=None, topology=topo, stats=get_comm_stats())
    assert good.tolist() == [float(r) for r in range(world) for _ in range(n)]
    return msgs


def _ef_mismatch(out, big, topo):
    ef = ErrorFeedback.for_spec(EF4)
    ef.store("b", torch.zeros(3))
    quantized_reduce_scatter(out, big, spec=EF4, topology=topo, error_feedback=ef, feedback_key="b")


def _world(rank: int, world: int, nodes: int, rpn: int) -> dict:
    torch.manual_seed(0)
    topo = Topology(nodes, rpn)
    groups = topo.build()
    assert dist.get_process_group_ranks(groups.intra) == topo.intra_ranks(rank)
    assert dist.get_process_group_ranks(groups.cross) == topo.cross_ranks(rank)
    assert dist.get_process_group_ranks(groups.hpz) == topo.hpz_ranks(rank)
    assert topo.build() is groups  # cached: no second set of groups
    res: dict = {"errors": _bad_calls(rank, world, topo)} if (nodes, rpn) == (2, 2) else {}
    res["checked"] = default_session().check_collectives
    stats = CommStats()
    res["all_gather_checks"] = _check_all_gather(rank, topo, stats)
    res["reduce_scatter_checks"] = _check_reduce_scatter(rank, topo, stats)
    _check_reduce_scatter_extras(rank, topo, stats)
    if nodes == 2:
        res["volumes"] = _zero3_vs_zeropp(rank, topo)
    return res


TOPOLOGIES = {"1x4": (1, 4), "2x2": (2, 2), "3x2": (3, 2), "2x4": (2, 4), "4x2": (4, 2), "3x1": (3, 1)}
CHECKED = ("3x2", "2x4")
"""Topologies run in the collectives debug mode (``CHECK_CALLS_ENV``): the same checks must pass
with every call checked (one hop and two, an odd node count); the others run without it."""


@pytest.fixture(scope="module", params=list(TOPOLOGIES))
def world(request) -> tuple[str, list[dict]]:
    """One world launch per topology, shared by the tests below (a launch costs seconds)."""
    nodes, rpn = TOPOLOGIES[request.param]
    env = CHECK_CALLS_ENV if request.param in CHECKED else None
    return request.param, run_world(_world, nodes * rpn, nodes, rpn, timeout=240, env=env)


def test_collectives_match_torch_distributed(world) -> None:
    """All checks ran on every rank (each asserts inside the rank; a failure fails the launch)."""
    _, res = world
    assert all(r["all_gather_checks"] == 27 + 3 + 1 for r in res)
    assert all(r["reduce_scatter_checks"] == 27 + 3 for r in res)
    assert all(r["checked"] is (name in CHECKED) for name, r in [(world[0], r) for r in res])


@pytest.mark.parametrize("world", ["2x2", "2x4"], indirect=True)
def test_zeropp_cuts_cross_node_bytes_to_a_quarter(world) -> None:
    _, res = world
    for r in res:
        v = r["volumes"]
        assert v["zeropp_cross"] / v["zero3_cross"] <= 0.25, v


@pytest.mark.parametrize("world", ["2x2"], indirect=True)
def test_bad_inputs_raise_on_every_rank(world) -> None:
    _, res = world
    for case in res[0]["errors"]:
        per_rank = [r["errors"][case] for r in res]
        assert all(m is not None for m in per_rank), f"{case}: some rank did not raise: {per_rank}"
        assert len(set(per_rank)) == 1, f"{case}: ranks raised different errors: {per_rank}"
    msgs = res[0]["errors"]
    assert "allocate output with 20 elements" in msgs["all-gather output of the wrong size"]
    assert "must hold 4 x 5 = 20 elements" in msgs["reduce-scatter input of the wrong size"]
    assert "QuantSpec.bits=3 is not supported" in msgs["unsupported bits"]
    assert "QuantSpec.intra_bits=2 is not supported" in msgs["unsupported intra_bits"]
    assert "QuantSpec.bits=6 is not supported" in msgs["unsupported all-gather bits"]
    assert "describes 8 ranks but the process group has 4" in msgs["topology of another world"]
    assert "odd" in msgs["odd group size for INT4"]
    assert "use spec=None" in msgs["MAX with quantization"]
    assert "wire_out must be a contiguous uint8 tensor of" in msgs["wire_out of the wrong size"]
    assert "it needs a spec" in msgs["wire_out without a spec"]
    assert (
        "intra_bits=16 asks for an unquantized intra-node hop"
        in msgs["unquantized intra hop under a quantized cross hop"]
    )
    assert "bits=None means no quantization; pass spec=None" in msgs["intra_bits without bits"]
    assert "error_feedback=True but no error_feedback state" in msgs["error feedback spec without state"]
    assert "spec.error_feedback=False" in msgs["error feedback state without spec flag"]
    assert "spec=None (a plain reduce-scatter rounds nothing)" in msgs["error feedback state on a plain reduce-scatter"]
    assert "intra_bits=8 does nothing for an all-gather" in msgs["all-gather with intra_bits"]
    assert "error_feedback=True does nothing for an all-gather" in msgs["all-gather with error feedback"]
    assert msgs["spec of the wrong type"].startswith("TypeError: spec must be a zeropp.comm.QuantSpec")
