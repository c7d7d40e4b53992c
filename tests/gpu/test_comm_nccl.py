"""The collectives on NCCL (one GPU per rank), against torch.distributed's own results.

Runs when two or more GPUs are present (worlds of 2 and, with four GPUs, 4 = 2 emulated nodes of
2, the hierarchical qgZ path). Every tensor lives on the rank's GPU, so a buffer the collectives
allocate on the wrong device fails NCCL ("No backend type associated with device type cpu").
Checks per rank: plain collectives equal torch.distributed's; quantized ones equal the algorithm
simulated with the kernels' CPU reference (the GPU kernels are bit-exact with it,
test_kernels_cuda.py) and lie within the quantization bound of torch.distributed's exact result;
byte accounting equals the formulas; error-feedback residuals and stochastic rounding behave as
on gloo. The world is started with torch's own ``torch.multiprocessing.spawn`` and a file store.
"""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.comm_helpers import (
    REL_ROUND,
    block_absmax,
    bytes_of,
    expected_all_gather_bytes,
    expected_reduce_scatter_bytes,
    qgz_error_bound,
    qmax,
    rank_input,
    simulate_qgz,
)
from zeropp.comm import (
    CommStats,
    ErrorFeedback,
    QuantSpec,
    ReduceOp,
    Topology,
    quantized_all_gather,
    quantized_all_reduce,
    quantized_reduce_scatter,
    reset_stochastic_calls,
    stochastic_seed,
)
from zeropp.comm.feedback import HOP2_SUFFIX
from zeropp.kernels import dequantize, quantize

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(GPUS < 2, reason=f"needs >= 2 GPUs for an NCCL world, found {GPUS}"),
]

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch >= 2.13 / older
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SIZES = (1, 7, 257)


def _all_gather_checks(rank: int, topo: Topology, dev: torch.device, stats: CommStats) -> None:
    W, gs = topo.world_size, 512
    for dtype in DTYPES:
        for n in SIZES:
            xs = [rank_input(1, r, n, dtype) for r in range(W)]  # CPU copies of every rank's shard
            mine = xs[rank].to(dev)
            ref = torch.empty(W * n, dtype=dtype, device=dev)
            _all_gather(ref, mine)
            for spec in (None, QuantSpec(bits=8), QuantSpec(bits=4)):
                out = torch.empty(W * n, dtype=dtype, device=dev)
                stats.reset()
                quantized_all_gather(out, mine, spec=spec, topology=topo, stats=stats)
                bits = None if spec is None else spec.bits
                assert out.device == dev
                assert bytes_of(stats, "all_gather") == expected_all_gather_bytes(topo, n, out.element_size(), bits, gs)
                if spec is None:
                    assert torch.equal(out, ref), (dtype, n)
                    continue
                exp = torch.cat([dequantize(quantize(x, bits, gs), dtype=dtype).view(-1) for x in xs])
                assert torch.equal(out.cpu(), exp), ("qwZ on NCCL != CPU reference", dtype, n, bits)
                true = ref.cpu().float()
                A = torch.cat([block_absmax(x.view(1, -1), gs).view(-1) for x in xs])
                bound = A / (2 * qmax(bits)) * (1 + 1e-5) + true.abs() * REL_ROUND[dtype] * 2
                assert ((out.cpu().float() - true).abs() <= bound).all(), (dtype, n, bits)
    # async handle + input aliasing the output, as FSDP2 passes it
    n = 7
    buf = torch.zeros(W * n, dtype=torch.bfloat16, device=dev)
    buf[rank * n : (rank + 1) * n] = rank_input(2, rank, n, torch.bfloat16).to(dev)
    h = quantized_all_gather(
        buf, buf[rank * n : (rank + 1) * n], spec=QuantSpec(bits=8), topology=topo, stats=stats, async_op=True
    )
    h.wait()
    exp = torch.cat(
        [
            dequantize(quantize(rank_input(2, r, n, torch.bfloat16), 8, 512), dtype=torch.bfloat16).view(-1)
            for r in range(W)
        ]
    )
    assert torch.equal(buf.cpu(), exp)


def _rank_order_sum(rows: list[torch.Tensor]) -> torch.Tensor:
    """The plain SUM reduce-scatter of ``zeropp.comm`` on gloo, written out: the rows added one at a
    time, rank 0 first, half precision accumulated in fp32 and rounded once (gloo's own ring adds
    in another order, so it differs in the last bits from four ranks on)."""
    acc_dtype = torch.float32 if rows[0].dtype in (torch.float16, torch.bfloat16) else rows[0].dtype
    acc = rows[0].to(acc_dtype)
    for row in rows[1:]:
        acc = acc + row.to(acc_dtype)
    return acc.to(rows[0].dtype)


def _reduce_scatter_checks(rank: int, topo: Topology, dev: torch.device, stats: CommStats) -> None:
    W, gs = topo.world_size, 128
    for dtype in DTYPES:
        for n in SIZES:
            xs = [rank_input(3 + n, r, W * n, dtype) for r in range(W)]
            mine = xs[rank].to(dev)
            ops = (
                ((ReduceOp.AVG, 1.0 / W), (ReduceOp.SUM, 1.0))
                if dist.get_backend() == "nccl"
                else ((ReduceOp.SUM, 1.0),)
            )
            for op, post in ops:  # (gloo, used only to exercise this file without GPUs, has no AVG)
                ref = torch.empty(n, dtype=dtype, device=dev)
                _reduce_scatter(ref, mine, op=op)
                exact = torch.stack([x.view(W, n)[rank].double() for x in xs]).sum(0) * post
                for bits, ibits in ((None, None), (8, 8), (4, 4), (4, 8)):
                    spec = None if bits is None else QuantSpec(bits=bits, intra_bits=ibits)
                    out = torch.empty(n, dtype=dtype, device=dev)
                    stats.reset()
                    quantized_reduce_scatter(out, mine, op, spec=spec, topology=topo, stats=stats)
                    what = (dtype, n, bits, ibits, str(op))
                    assert out.device == dev
                    assert bytes_of(stats, "reduce_scatter") == expected_reduce_scatter_bytes(
                        topo, n, out.element_size(), bits, ibits, gs
                    ), what
                    if spec is None:
                        if dist.get_backend() != "nccl":  # zeropp's gloo SUM: rows added in rank order
                            ref = _rank_order_sum([x.view(W, n)[rank] for x in xs]).to(dev)
                        assert torch.equal(out, ref), what
                        continue
                    sim = simulate_qgz(xs, topo, rank, n, bits, ibits, gs).mul(post).to(dtype)
                    assert torch.equal(out.cpu(), sim), ("qgZ on NCCL != simulated", *what)
                    bound = qgz_error_bound(xs, topo, rank, n, bits, ibits, gs).double() * post
                    bound = bound + exact.abs() * REL_ROUND[dtype] * 2 + 1e-30
                    assert ((out.cpu().double() - exact).abs() <= bound).all(), what
    # error feedback: the residual lives on the GPU and is added to the next call's input
    n = 9
    xs = [rank_input(50, r, W * n, torch.float32) for r in range(W)]
    spec = QuantSpec(bits=4, error_feedback=True, residual_bits=32)  # fp32 residuals: exact checks
    ef = ErrorFeedback.for_spec(spec)
    out = torch.empty(n, device=dev)
    quantized_reduce_scatter(
        out, xs[rank].to(dev), ReduceOp.SUM, spec=spec, error_feedback=ef, feedback_key="b", topology=topo, stats=stats
    )
    r = ef.residual("b", W * n, dev)
    assert r.device == dev and float(r.abs().sum()) > 0
    x2 = [rank_input(51, q, W * n, torch.float32) for q in range(W)]
    res = [x.view(W, n) - dequantize(quantize(x.view(W, n), 4, gs, rows=W)) for x in xs]
    assert torch.equal(r.cpu(), res[rank].view(-1))  # in input order, also after qgZ's swizzle
    ef.reset("b" + HOP2_SUFFIX)  # hop 1 only here; tests/distributed/test_comm_feedback.py checks both hops
    quantized_reduce_scatter(
        out, x2[rank].to(dev), ReduceOp.SUM, spec=spec, error_feedback=ef, feedback_key="b", topology=topo, stats=stats
    )
    comp = [x2[q] + res[q].view(-1) for q in range(W)]
    assert torch.equal(out.cpu(), simulate_qgz(comp, topo, rank, n, 4, 4, gs))


def _stochastic_and_all_reduce(rank: int, topo: Topology, dev: torch.device, stats: CommStats) -> None:
    W, n = topo.world_size, 300
    xs = [rank_input(7, r, n, torch.float32) for r in range(W)]
    reset_stochastic_calls(4)
    out = torch.empty(W * n, device=dev)
    quantized_all_gather(
        out,
        xs[rank].to(dev),
        spec=QuantSpec(bits=4, group_size=128, rounding="stochastic", seed=9),
        topology=topo,
        stats=stats,
    )
    want = torch.cat(
        [dequantize(quantize(xs[r], 4, 128, stochastic=True, seed=stochastic_seed(9, r, 4))).view(-1) for r in range(W)]
    )
    assert torch.equal(out.cpu(), want)
    # all-reduce of an odd-size tensor (the DDP hook's collective) against torch's AVG all-reduce
    t = rank_input(8, rank, 1001, torch.float32).to(dev)
    ref = t.clone()
    dist.all_reduce(ref)
    ref /= W
    quantized_all_reduce(t, spec=QuantSpec(bits=8), gather_spec=QuantSpec(bits=8), topology=topo, stats=stats)
    assert t.device == dev and torch.allclose(t, ref, atol=float(ref.abs().max()) / 40)


def _worker(rank: int, world: int, store_path: str, backend: str) -> None:
    kw: dict[str, Any] = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        kw["device_id"] = dev  # bound to the group: barrier() knows its GPU (no guess, no warning)
    else:  # gloo on CPU: lets the test's own logic be exercised without GPUs
        dev = torch.device("cpu")
    dist.init_process_group(
        backend,
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
        **kw,
    )
    try:
        shapes = [(1, world), (world, 1)] + ([(2, world // 2)] if world % 2 == 0 and world >= 4 else [])
        stats = CommStats()
        for nodes, rpn in shapes:
            topo = Topology(nodes, rpn)
            _all_gather_checks(rank, topo, dev, stats)
            _reduce_scatter_checks(rank, topo, dev, stats)
            _stochastic_and_all_reduce(rank, topo, dev, stats)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_spawned(world: int, tmp_path, backend: str = "nccl", start_method: str = "spawn") -> None:
    """Start ``world`` ranks with torch.multiprocessing (spawned: what CUDA needs; the gloo mode
    may fork them from the tests' preloaded fork server instead); a failing rank fails the call."""
    torch.multiprocessing.start_processes(
        _worker, args=(world, str(tmp_path / "store"), backend), nprocs=world, join=True, start_method=start_method
    )


@pytest.mark.parametrize("world", [w for w in (2, 4) if w <= GPUS] or [2])
def test_collectives_on_nccl_match_torch_distributed(world: int, tmp_path) -> None:
    run_spawned(world, tmp_path)
