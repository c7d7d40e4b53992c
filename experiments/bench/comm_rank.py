"""``bench_comm``'s rank side: each collective timed over each group, plain and through each codec.

One rank of the benchmark world (started by ``comm.py`` through the launcher, or by torchrun)
reads a :class:`CommBenchSpec`, joins the process group from the torchrun environment and, for
every group (``world``, ``intra``: this rank's node, ``inter``: one rank per node), collective,
format and size, runs ``warmup`` untimed calls and then ``iters`` timed ones, each after a barrier
of the group, so every member starts together; a call's time is the slowest member's (a MAX
all-reduce of the times), and a row keeps the median. The quantized collectives are the library's
own (``zeropp.comm.quantized_all_gather`` / ``quantized_reduce_scatter`` / ``quantized_all_reduce``);
zeropp.comm has no public quantized all-to-all, so that one is the codec's encode, the backend
all-to-all of the wire rows and the codec's decode -- the pieces qgZ's hops are made of. Then the
codecs' kernel ops are timed on every rank at once (contended as in a training step) for the
cluster file's ``(op, format)`` quantization rates.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from typing import Any, Callable

OPS = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")
"""The collectives measured, under nccl-tests' names (without ``_perf``)."""

GROUPS = ("world", "intra", "inter")
"""``world``: every rank; ``intra``: the ranks of this rank's node; ``inter``: one rank per node."""

KERNEL_OPS = ("quantize", "dequantize", "dequantize_sum", "dequantize_sum_requantize")
"""The codec ops whose rates go in a cluster file (``experiments.projection.scaling.QUANT_OPS``)."""


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor of ``op`` over ``n`` ranks (its PERFORMANCE.md): busbw =
    algbw x factor, the rate each rank's busiest link ran at, comparable across ``n``."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    raise ValueError(f"unknown collective {op!r}; use one of {OPS}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommBenchSpec:
    """What every rank measures (written as JSON by the launcher, read by each rank)."""

    nodes: int
    """Nodes of the world (its ranks are ``nodes x ranks_per_node``, node-major)."""
    ranks_per_node: int
    """Ranks per node."""
    ops: tuple[str, ...] = OPS
    """Collectives to time (:data:`OPS`)."""
    groups: tuple[str, ...] = GROUPS
    """Groups to time them over (:data:`GROUPS`; those of one rank, or equal to the world, are skipped)."""
    formats: tuple[str, ...] = ()
    """Wire formats (``scaling.format_name`` of a registered scheme and width, e.g. ``int8``,
    ``mxfp4``), each timed beside the plain collective."""
    sizes: tuple[int, ...] = (1024,)
    """Bytes of each call's full-precision buffer (nccl-tests' size: the gathered output, the
    reduced input, the all-reduced or all-to-all'ed buffer)."""
    warmup: int = 2
    """Untimed calls before each measurement."""
    iters: int = 5
    """Timed calls per measurement (the row keeps their median)."""
    out: str = ""
    """Where rank 0 writes the results (JSON); empty: nowhere (the caller reads the return value)."""

    def __post_init__(self) -> None:
        checks = (
            ("nodes", self.nodes >= 1, "use >= 1"),
            ("ranks_per_node", self.ranks_per_node >= 1, "use >= 1"),
            ("ops", bool(self.ops) and set(self.ops) <= set(OPS), f"use some of {OPS}"),
            ("groups", bool(self.groups) and set(self.groups) <= set(GROUPS), f"use some of {GROUPS}"),
            ("sizes", bool(self.sizes) and min(self.sizes) >= 4, "give sizes of >= 4 bytes"),
            ("warmup", self.warmup >= 0, "use >= 0"),
            ("iters", self.iters >= 1, "use >= 1"),
        )
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"CommBenchSpec.{name}={getattr(self, name)!r}; {allowed}")
        format_specs(self.formats)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CommBenchSpec:
        """The spec of :func:`dataclasses.asdict` ``d`` (its lists back to tuples)."""
        fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
        return cls(**fields)

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node


def format_specs(names: tuple[str, ...] | None = None) -> dict[str, Any]:
    """``{format: QuantSpec}`` of the registered schemes at each of their widths (``names``: only
    these, an earlier spelling taken as its name (``mx4``: ``mxfp4``, ``scaling.FORMAT_ALIASES``);
    an unknown one raises ValueError listing the known ones)."""
    from zeropp.comm.spec import QuantSpec, schemes

    from ..projection.scaling import canonical_format, format_name

    known = {}
    for scheme, widths in schemes().items():
        for bits in widths:
            spec = QuantSpec(scheme=scheme, bits=bits)
            known[format_name(spec, bits)] = spec
    if names is None:
        return known
    names = tuple(canonical_format(n) for n in names)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown wire format(s) {unknown}; use some of {sorted(known)} (or none)")
    return {n: known[n] for n in names}


def algorithm(op: str, fmt: str | None, group: str, spec: CommBenchSpec, backend: str) -> str:
    """How the call moves its bytes: the backend's schedule (gloo runs all-gathers and
    all-reduces as rings and a reduce-scatter as a ring all-reduce; NCCL picks ring or tree per
    call, reported as ``nccl``), or the quantized path."""
    if fmt is None:
        if backend != "gloo":
            return backend
        return {"all_to_all": "pairwise", "reduce_scatter": "ring all-reduce"}.get(op, "ring")
    if op == "reduce_scatter":
        two_hops = group == "world" and spec.nodes > 1 and spec.ranks_per_node > 1
        return f"qgZ {'2-hop a2a' if two_hops else 'a2a'}"
    if op == "all_reduce":
        return "qgZ rs + q ag"
    return "encode+" + ("pairwise" if op == "all_to_all" else "ring") + "+decode"


def _call(
    op: str, fmt_spec: Any, group: Any, n: int, elems: int, topo: Any, stats: Any, device: Any
) -> Callable[[], object]:
    """One collective of ``elems`` full-precision elements over ``group`` (``n`` members) on
    ``device``, ready to call."""
    import torch

    from zeropp.comm import ReduceOp, all_reduce, quantized_all_gather, quantized_all_reduce, quantized_reduce_scatter
    from zeropp.comm.backend import backend_all_to_all
    from zeropp.comm.codecs import codec_for
    from zeropp.runtime.plan_kinds import group_size_of

    x = torch.randn(elems, device=device)  # [elems] fp32: the nccl-tests size
    if op == "all_gather":
        shard, out = x[: elems // n].clone(), torch.empty(elems, device=device)  # [elems / n], [elems]
        return lambda: quantized_all_gather(out, shard, group, spec=fmt_spec, topology=topo, stats=stats)
    if op == "reduce_scatter":
        chunk = torch.empty(elems // n, device=device)  # [elems / n]
        return lambda: quantized_reduce_scatter(
            chunk, x, ReduceOp.SUM, group, spec=fmt_spec, topology=topo, stats=stats
        )
    if op == "all_reduce":
        if fmt_spec is None:
            return lambda: all_reduce(x, ReduceOp.SUM, group, topology=topo, stats=stats)
        return lambda: quantized_all_reduce(
            x, ReduceOp.SUM, group, spec=fmt_spec, gather_spec=fmt_spec, topology=topo, stats=stats
        )
    recv = torch.empty(elems, device=device)  # [elems]
    if fmt_spec is None:
        return lambda: backend_all_to_all(recv, x, group, False)
    codec, gs, bits, cols = codec_for(fmt_spec), group_size_of(fmt_spec, weights=False), fmt_spec.bits, elems // n

    def quantized() -> None:
        rows = codec.encode(x, bits, gs, rows=n, seed=None)  # [n, B]: one wire row per peer
        wire = torch.empty_like(rows)
        backend_all_to_all(wire, rows, group, False)
        codec.dequantize(codec.unpack(wire, cols, bits, gs), out=recv.view(n, cols))

    return quantized


def _time(fn: Callable[[], object], group: Any, warmup: int, iters: int, device: Any) -> list[float]:
    """Seconds of each timed call, the slowest member's (see the module doc); on a GPU each call
    is waited for (``torch.cuda.synchronize``) before its clock stops."""
    import torch
    import torch.distributed as dist

    cuda = device.type == "cuda"
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    t = torch.tensor(times, dtype=torch.float64, device=device)  # [iters]
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def _groups(spec: CommBenchSpec, built: Any) -> list[tuple[str, Any, int]]:
    """``(name, group, members)`` of the spec's groups that have >= 2 members and differ from the world."""
    sizes = {"world": spec.world, "intra": spec.ranks_per_node, "inter": spec.nodes}
    handles = {"world": built.world, "intra": built.intra, "inter": built.cross}
    return [(g, handles[g], sizes[g]) for g in spec.groups if sizes[g] >= 2 and (g == "world" or sizes[g] < spec.world)]


def _kernel_calls(qs: Any, x: Any, W: int, cols: int) -> dict[str, Callable[[], object]]:
    """Each :data:`KERNEL_OPS` op of ``qs``'s codec on ``x`` (``W`` rows of ``cols``), as the
    collectives call it: gathers at the weights' group size, reductions at the gradients'."""
    from zeropp.comm.codecs import codec_for
    from zeropp.runtime.plan_kinds import group_size_of

    codec, b = codec_for(qs), qs.bits
    gw, gg = group_size_of(qs, weights=True), group_size_of(qs, weights=False)
    rw = codec.encode(x, b, gw, rows=W, seed=None)  # [W, B]
    rg = codec.encode(x, b, gg, rows=W, seed=None).view(W, 1, -1)  # [W sources, 1, B]
    return {
        "quantize": lambda: codec.encode(x, b, gw, rows=W, seed=None),
        "dequantize": lambda: codec.dequantize(codec.unpack(rw, cols, b, gw)),
        "dequantize_sum": lambda: codec.dequantize_sum(rg, cols, b, gg),
        "dequantize_sum_requantize": lambda: codec.dequantize_sum_requantize(rg, cols, b, gg, out_bits=b, seed=None),
    }


def kernel_rates(spec: CommBenchSpec, elems: int, device: Any, repeats: int = 3) -> list[dict[str, Any]]:
    """GB/s (of fp32 input) of each codec op of :data:`KERNEL_OPS` per format, on ``elems``
    elements as ``world`` wire rows, median of ``repeats``; every rank times at once."""
    import torch

    from zeropp.kernels.timing import median_seconds

    W = spec.world
    cols = max(elems // W, 1)
    x = torch.randn(W * cols, device=device)  # [W * cols]
    out = []
    for fmt, qs in format_specs(spec.formats).items():
        for op, fn in _kernel_calls(qs, x, W, cols).items():
            sec = median_seconds(fn, device=device, warmup=1, iters=repeats)
            out.append({"op": op, "format": fmt, "gbs": W * cols * 4 / max(sec, 1e-9) / 1e9})
    return out


def rank_main(spec: CommBenchSpec) -> dict[str, Any] | None:
    """Run the benchmark on this rank: join the process group from the torchrun env (NCCL where
    there are GPUs, else gloo), :func:`run_rank`, destroy the group. Rank 0 returns (and writes
    to ``spec.out``) the results."""
    import torch
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "gloo"
    dist.init_process_group(backend)
    try:
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        result = run_rank(spec, backend)
        if result is not None and spec.out:
            with open(spec.out, "w") as f:
                json.dump(result, f)
        return result
    finally:
        dist.destroy_process_group()


def run_rank(spec: CommBenchSpec, backend: str) -> dict[str, Any] | None:
    """Every measurement of ``spec`` on this rank of the initialised world; rank 0 returns
    ``{"backend", "nodes", "ranks_per_node", "rows", "quant_rates"}``, the others None."""
    import torch
    import torch.distributed as dist

    from zeropp.comm import CommStats, Topology

    torch.set_num_threads(1)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    topo = Topology(nodes=spec.nodes, ranks_per_node=spec.ranks_per_node)
    built, stats = topo.build(), CommStats()
    specs: dict[str | None, Any] = {None: None}
    specs.update(format_specs(spec.formats))
    rows = []
    for gname, group, n in _groups(spec, built):
        for op in spec.ops:
            for fmt, qs in specs.items():
                for size in spec.sizes:
                    elems = max(size // 4 // n, 1) * n
                    fn = _call(op, qs, group, n, elems, topo, stats, device)
                    t = statistics.median(_time(fn, group, spec.warmup, spec.iters, device))
                    algbw = elems * 4 / t
                    rows.append(
                        {
                            "group": gname,
                            "ranks": n,
                            "op": op,
                            "format": fmt or "plain",
                            "bytes": elems * 4,
                            "seconds": t,
                            "algorithm": algorithm(op, fmt, gname, spec, backend),
                            "algbw_gbs": algbw / 1e9,
                            "busbw_gbs": algbw * busbw_factor(op, n) / 1e9,
                        }
                    )
    dist.barrier()
    rates = kernel_rates(spec, max(spec.sizes) // 4, device) if spec.formats else []
    dist.barrier()
    if dist.get_rank() != 0:
        return None
    return {
        "backend": backend,
        "nodes": spec.nodes,
        "ranks_per_node": spec.ranks_per_node,
        "rows": rows,
        "quant_rates": rates,
    }
