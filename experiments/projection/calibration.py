"""This machine's rates, measured for the cost model: the quantization kernels at a run's own
shapes, alone or with every rank at once, and the loopback rate of a gloo world.

The projection charges quantization at these rates (``Workload.quant_rates``) rather than
assuming it free, and ``scaling_check`` / ``bench_cluster --check`` take the loopback rate as an
emulated node's intra-node link. Measuring starts processes (a pool, or a gloo world through the
launcher); the formulas never do.
"""

from __future__ import annotations

import statistics
import time

from .spec import GBPS, Cluster, Workload


def measure_quant_rates(
    w: Workload, c: Cluster, *, repeats: int = 3, threads: int | None = 1
) -> tuple[tuple[str, int, float], ...]:
    """Throughput of each quantize/dequantize op a step of ``w`` on ``c`` runs, timed on this
    machine with zeropp.kernels at exactly the per-rank shapes zeropp.comm uses (one call per
    communication unit, median of ``repeats``), as ``Workload.quant_rates``: ``(op, bits, GB/s
    of full-precision input)``. On CPU tensors this is the torch reference; call it where the
    run ran, under a load like the run's (ranks sharing the cores). ``threads``:
    torch intra-op threads while timing (1, as each rank of a CPU run uses; None: leave as is)."""
    import torch

    saved = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _time_quant_ops(w, c, repeats)
    finally:
        torch.set_num_threads(saved)


def _rates_worker(args: tuple) -> tuple[tuple[str, int, float], ...]:
    w, c, repeats, start = args
    while time.time() < start:  # every process times at once, so they contend as the ranks do
        time.sleep(0.005)
    return measure_quant_rates(w, c, repeats=repeats)


def measure_quant_rates_contended(
    w: Workload, c: Cluster, *, procs: int | None = None, repeats: int = 3
) -> tuple[tuple[str, int, float], ...]:
    """:func:`measure_quant_rates` in ``procs`` processes at once (default: the world size, one
    per rank, one thread each), median rate per op: the kernels as the run's ranks ran them,
    sharing this host's cores with each other and with whatever else loads it at the time. On
    an oversubscribed CPU this replaces scaling a lone process's rate by a guessed core share."""
    import multiprocessing as mp

    n = procs or c.world
    if n <= 1:
        return measure_quant_rates(w, c, repeats=repeats)
    ctx = mp.get_context("spawn")
    with ctx.Pool(n) as pool:
        start = time.time() + 2.0 + 0.5 * n  # after every worker has imported torch
        results = pool.map(_rates_worker, [(w, c, repeats, start)] * n)
    out = []
    for i, (op, bits, _) in enumerate(results[0]):
        out.append((op, bits, statistics.median(r[i][2] for r in results)))
    return tuple(out)


def _loopback_rank(rank: int, world: int, nbytes: int, repeats: int) -> float:
    import torch
    import torch.distributed as dist

    from zeropp.comm.backend import backend_all_gather

    x = torch.ones(nbytes // 4)  # [n] fp32
    out = torch.empty(world * x.numel())  # [world * n]
    backend_all_gather(out, x, None, False)  # warm the connections
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        backend_all_gather(out, x, None, False)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_loopback_gbps(world: int, *, nbytes: int = 1 << 20, repeats: int = 5, timeout_s: float = 120.0) -> float:
    """The intra-node (loopback) rate of ``world`` gloo ranks on this host, Gbit/s per rank: a
    plain all-gather of ``nbytes`` per rank, each rank sending ``(world - 1) x nbytes``, timed
    (median, slowest rank) with every rank running at once, one thread each -- the copies
    through the kernel's TCP loopback that an emulated node's ranks make, under this host's load."""
    from ..launch import launch_world

    t = max(
        launch_world(
            _loopback_rank, world, args=(nbytes, repeats), process_group="gloo", threads=1, timeout_s=timeout_s
        )
    )
    return (world - 1) * nbytes / max(t, 1e-9) / GBPS


def _time_quant_ops(w: Workload, c: Cluster, repeats: int) -> tuple[tuple[str, int, float], ...]:
    """Median GB/s (of full-precision input) of each ``(op, bits)`` of :func:`quant_work`, run
    through the specs' codecs on wire rows exactly as the collectives call them, so every
    registered scheme (int's fused kernels, the float formats' generic reductions) is timed."""
    import torch

    from zeropp.comm.codecs import codec_for

    dtype = torch.float32 if w.dtype_bytes == 4 else torch.bfloat16
    W, R, N = c.world, c.ranks_per_node, c.nodes
    shards = [-(-u // W) for u in w.coalesced().units]  # one call per unit the engine moves
    gen = torch.Generator().manual_seed(0)

    def rand(n: int) -> torch.Tensor:
        return torch.randn(n, generator=gen).to(dtype)

    calls: dict[tuple[str, int], list] = {}  # (op, bits) -> [(fn, elements)]
    for n in shards:
        if w.weights:
            cw, b, gs = codec_for(w.weights), w.weights.bits, w.weight_group_size
            calls.setdefault(("quantize", b), []).append(
                (lambda x=rand(n), cw=cw, b=b, gs=gs: cw.encode(x, b, gs, rows=1, seed=None), n)
            )
            rows = cw.encode(rand(W * n), b, gs, rows=W, seed=None)  # [W, B]
            calls.setdefault(("dequantize", b), []).append(
                (lambda r=rows, cw=cw, b=b, gs=gs, n=n: cw.dequantize(cw.unpack(r, n, b, gs), dtype=dtype), W * n)
            )
        if w.grads:
            cg, gs, (ib, b) = codec_for(w.grads), w.grad_group_size, w.grads.hop_bits
            if N > 1 and R > 1:
                calls.setdefault(("quantize", ib), []).append(
                    (lambda x=rand(W * n), cg=cg, ib=ib, gs=gs: cg.encode(x, ib, gs, rows=W, seed=None), W * n)
                )
                hop1 = cg.encode(rand(W * n), ib, gs, rows=W, seed=None).view(R, N, -1)  # [rpn sources, nodes, B1]
                calls.setdefault(("dequantize_sum_requantize", ib), []).append(
                    (
                        lambda r=hop1, cg=cg, ib=ib, b=b, gs=gs, n=n: cg.dequantize_sum_requantize(
                            r, n, ib, gs, out_bits=b, seed=None
                        ),
                        W * n,
                    )
                )
                hop2 = cg.encode(rand(N * n), b, gs, rows=N, seed=None).view(N, 1, -1)  # [nodes, 1, B2]
                calls.setdefault(("dequantize_sum", b), []).append(
                    (lambda r=hop2, cg=cg, b=b, gs=gs, n=n: cg.dequantize_sum(r, n, b, gs), N * n)
                )
            else:
                sb = ib if N == 1 else b
                calls.setdefault(("quantize", sb), []).append(
                    (lambda x=rand(W * n), cg=cg, sb=sb, gs=gs: cg.encode(x, sb, gs, rows=W, seed=None), W * n)
                )
                one = cg.encode(rand(W * n), sb, gs, rows=W, seed=None).view(W, 1, -1)  # [W sources, 1, B]
                calls.setdefault(("dequantize_sum", sb), []).append(
                    (lambda r=one, cg=cg, sb=sb, gs=gs, n=n: cg.dequantize_sum(r, n, sb, gs), W * n)
                )
    out = []
    for (op, bits), fns in sorted(calls.items()):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for fn, _n in fns:
                fn()
            times.append(time.perf_counter() - t0)
        elems = sum(n for _fn, n in fns)
        out.append((op, bits, elems * w.dtype_bytes / max(statistics.median(times), 1e-9) / 1e9))
    return tuple(out)
