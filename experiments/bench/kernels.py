"""Bandwidth of the quantization kernels against a plain copy and against ``torch.compile`` of
the plain torch formulation of the same op, all measured in the same run.

    python -m experiments.bench_kernels                 # GPU: Triton kernels, 64 KiB .. 1 GiB
    python -m experiments.bench_kernels                 # CPU: the CPU path (kernels/cpu.py), 64 KiB .. 64 MiB
    python -m experiments.bench_kernels --max-mib 256   # larger sizes
    python -m experiments.bench_kernels --cpu-path tiled   # CPU: only the tiled path (the pre-native baseline)
    python -m experiments.bench_kernels --vs-path none     # CPU: skip the paired old-path timing

On CPU each op is also timed through an older CPU path in the same run (``--vs-path``, default
the tiled path, the plain-torch baseline the native kernels replaced): the two are timed in alternation,
call by call, and "x old" is the median of the per-pair ratios (old time / ours), which a shared
machine's load changes affect far less than two separate runs. Both run against the same copy
timing, so the ratio of the shares of copy bandwidth ("of copy" / "old of copy") equals "x old".

Why a copy baseline: quantize, dequantize and the fused reduce are memory-bound, so the honest
yardstick is what the same device reaches moving bytes with no arithmetic at all. Each op row is
compared with ``dst.copy_(src)`` moving the same number of bytes (read + written) at that size.

Why a ``torch.compile`` baseline: it is what a user would write instead, block quantization in a
few lines of torch (``amax``, a division, ``round``, a cast), compiled by inductor. It is not
bit-exact with the reference (``round`` is half-to-even; no NaN-block handling), only the same work.
Column "vs compile" = compiled baseline's time / our time (> 1: ours is faster). The baseline's
formulations are ``kernels_plain.py``.

Byte convention: "bytes moved" = bytes the op must read plus bytes it must write, each counted
once (codes, fp32 scales and full-precision tensors alike); GB/s = bytes moved / time / 1e9.
"size" is the full-precision input of one tensor (``n`` elements of ``--dtype``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import statistics
import time
from typing import Callable, Iterator, NoReturn

import torch

from zeropp.kernels import (
    QuantizedTensor,
    cpu_fused,
    cpu_native,
    dequantize,
    dequantize_sum,
    dequantize_sum_requantize,
    quantize,
    quantized_nbytes,
    timing,
)

from ..launch.command import run_command
from . import format_rows
from .args import flag, require_at_least
from .kernels_plain import Compiled, plain_dequantize, plain_dequantize_sum, plain_quantize, plain_reduce

TARGET_FRACTION = 0.90
"""Goal on H100/H200: >= 90% of the measured copy bandwidth for sizes >= 64 MiB."""


def _timer(device: torch.device, warmup: int, iters: int) -> Callable[[Callable[[], object]], float]:
    """Median seconds per call: CUDA events around each call on GPU, perf_counter on CPU."""
    return functools.partial(timing.median_seconds, device=device, warmup=warmup, iters=iters)


CPU_PATHS = ("auto", "native", "compiled", "tiled")
"""CPU paths: auto = what ranks run (the native kernels, else the compiled / tiled paths);
native = the native kernels (``kernels/cpu_native.py``); compiled = ``torch.compile``'d kernels of
``kernels/cpu_fused.py`` from their size thresholds, tiles below (the compiled
baseline); tiled = the cache-sized tiles only (the plain-torch baseline)."""


@contextlib.contextmanager
def cpu_path(path: str) -> Iterator[None]:
    """Route CPU tensors through ``path`` (one of :data:`CPU_PATHS`) inside the block."""
    saved = cpu_native.ENABLED, cpu_fused.FUSED_MIN_ELEMS, cpu_fused.DEQUANTIZE_MIN_ELEMS
    try:
        if path in ("compiled", "tiled"):
            cpu_native.ENABLED = False
        if path == "tiled":
            cpu_fused.FUSED_MIN_ELEMS = cpu_fused.DEQUANTIZE_MIN_ELEMS = 2**62
        if path == "native" and not cpu_native.available():
            raise RuntimeError(f"--cpu-path native: the native kernels are unavailable ({cpu_native.FAILED})")
        yield
    finally:
        cpu_native.ENABLED, cpu_fused.FUSED_MIN_ELEMS, cpu_fused.DEQUANTIZE_MIN_ELEMS = saved


def _paired(fn: Callable[[], object], path: str, old: str, warmup: int, iters: int) -> tuple[float, float, float]:
    """``fn`` through CPU path ``path`` and through ``old``, alternating call by call. Returns
    (median seconds ours, median seconds old, median of the per-pair ratios old / ours)."""
    return _alternate((fn, path), (fn, old), warmup, iters)


def _alternate(
    ours: tuple[Callable[[], object], str], old: tuple[Callable[[], object], str], warmup: int, iters: int
) -> tuple[float, float, float]:
    """Two ``(function, CPU path)`` timed in alternation, call by call (each inside its path, the
    path switch untimed). Returns (median seconds ours, median seconds old, median of the per-pair
    ratios old / ours): a shared machine's load changes affect the ratio far less than two runs."""
    for _ in range(warmup):
        for fn, p in (ours, old):
            with cpu_path(p):
                fn()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(iters):
        for (fn, p), acc in zip((ours, old), times):
            with cpu_path(p):
                t0 = time.perf_counter()
                fn()
                acc.append(time.perf_counter() - t0)
    ratio = statistics.median(o / n for o, n in zip(times[1], times[0]))
    return statistics.median(times[0]), statistics.median(times[1]), ratio


def _sizes(min_kib: float, max_mib: float) -> list[int]:
    """Input bytes from min_kib KiB in x4 steps (64 KiB, 256 KiB, ... 256 MiB), ending at max_mib."""
    lo, top = int(min_kib * 1024), int(max_mib * 1024 * 1024)
    if not 1 <= lo <= top:  # a start of 0 bytes would never grow: refuse rather than loop forever
        raise ValueError(f"sizes from {min_kib:g} KiB to {max_mib:g} MiB: need 1 byte <= smallest <= largest")
    out = []
    while lo <= top:
        out.append(lo)
        lo *= 4
    if not out or out[-1] < top:
        out.append(top)
    return out


def _fmt_bytes(b: int) -> str:
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= div:
            return f"{b / div:g} {unit}"
    return f"{b} B"


def bench(args: argparse.Namespace, on_row: Callable[[dict], None] | None = None) -> list[dict]:
    """Time every op at every size; ``on_row`` sees each row as soon as it is measured (the table
    streams, so a run stopped by a time limit still shows what it measured)."""
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    esize = torch.empty((), dtype=dtype).element_size()
    timeit = _timer(device, args.warmup, args.iters)
    copy_cache: dict[int, float] = {}

    def copy_seconds(nbytes: int) -> float:
        """Time of ``dst.copy_(src)`` moving ``nbytes`` in total (nbytes/2 read, nbytes/2 written)."""
        half = max(1, nbytes // 2)
        if half not in copy_cache:
            src = torch.empty(half, dtype=torch.uint8, device=device).random_(0, 255)
            dst = torch.empty_like(src)
            copy_cache[half] = timeit(lambda: dst.copy_(src)) * nbytes / (2 * half)
        return copy_cache[half]

    rows: list[dict] = []

    compiled = Compiled()

    paired = _paired_mode(args)

    def pair(fused: Callable[[], object], generic: Callable[[], object]) -> tuple[float, float, float]:
        """Seconds of ``fused`` and ``generic`` and the ratio generic / fused: on CPU timed in
        alternation through ``--cpu-path``, on CUDA one after the other."""
        if device.type == "cpu":
            return _alternate((fused, args.cpu_path), (generic, args.cpu_path), args.warmup, args.iters)
        sf, sg = timeit(fused), timeit(generic)
        return sf, sg, sg / sf

    def record(
        op: str,
        size: int,
        nbytes: int,
        fn: Callable[[], object] | None,
        baseline: Callable[[], object] | None = None,
        seconds: float | None = None,
        **extra: object,
    ) -> None:
        """One row: ``fn`` timed (through ``--cpu-path``, paired with ``--vs-path`` on CPU)."""
        old_seconds = vs_old = None
        if fn is not None and paired:
            seconds, old_seconds, vs_old = _paired(fn, args.cpu_path, args.vs_path, args.warmup, args.iters)
        elif fn is not None:
            with cpu_path(args.cpu_path) if device.type == "cpu" else contextlib.nullcontext():
                seconds = timeit(fn)
        assert seconds is not None, "record() needs fn or seconds"
        gbps = nbytes / seconds / 1e9
        copy_s = copy_seconds(nbytes)
        vs = timeit(baseline) / seconds if baseline is not None and not args.no_compile else None
        rows.append(
            dict(
                op=op,
                size=size,
                bytes=nbytes,
                seconds=seconds,
                gbps=gbps,
                fraction=copy_s / seconds,
                vs_compile=vs,
                old_fraction=None if old_seconds is None else copy_s / old_seconds,
                vs_old=vs_old,
                **extra,
            )
        )
        if on_row is not None:
            on_row(rows[-1])

    k = args.k
    for size in _sizes(args.min_kib, args.max_mib):
        n = max(1, size // esize)
        x = torch.randn(n, device=device).to(dtype)  # [n]
        record("copy", size, 2 * n * esize, None, seconds=copy_seconds(2 * n * esize))
        for bits, gs in ((8, 512), (4, 128)):
            nb = -(-n // gs)
            xb = torch.nn.functional.pad(x, (0, nb * gs - n)).view(nb, gs)  # [blocks, gs] for the baseline
            qb = quantized_nbytes(1, n, bits, gs)  # codes + scales of one tensor
            q = quantize(x, bits, gs)
            record(
                f"quantize int{bits} g{gs}",
                size,
                n * esize + qb,
                lambda: quantize(x, bits, gs),
                compiled(f"q{bits}", plain_quantize, xb, dims=(0,), bits=bits),
            )
            out = torch.empty(n, dtype=dtype, device=device)
            cb, sb = q.codes.view(nb, -1), q.scales.view(nb)
            record(
                f"dequantize int{bits} g{gs}",
                size,
                qb + n * esize,
                lambda: dequantize(q, out=out),
                compiled(f"dq{bits}", plain_dequantize, cb, sb, dims=(0, 0), bits=bits, dtype=dtype),
            )
            if bits == 4:  # stochastic rounding adds Philox work, not bytes
                record(
                    "quantize int4 g128 stochastic",
                    size,
                    n * esize + qb,
                    lambda: quantize(x, 4, 128, stochastic=True, seed=1),
                    compiled("q4s", plain_quantize, xb, dims=(0,), bits=4, stochastic=True),
                )
        gs = 128
        nb = -(-n // gs)
        qs = [quantize(torch.randn(n, device=device), 4, gs) for _ in range(k)]
        stacked = QuantizedTensor(torch.stack([q.codes for q in qs]), torch.stack([q.scales for q in qs]), n, 4, gs)
        cb, sb = stacked.codes.view(k, nb, -1), stacked.scales.view(k, nb)
        qb = quantized_nbytes(1, n, 4, gs)
        record(
            f"fused reduce int4 g{gs} k{k}",
            size,
            (k + 1) * qb,
            lambda: dequantize_sum_requantize(stacked, 4),
            compiled("reduce", plain_reduce, cb, sb, dims=(1, 1), bits=4),
        )
        out = torch.empty(n, dtype=dtype, device=device)
        record(
            f"dequantize_sum int4 g{gs} k{k}",
            size,
            k * qb + n * esize,
            lambda: dequantize_sum(stacked, out=out),
            compiled("dsum", plain_dequantize_sum, cb, sb, dims=(1, 1), bits=4, dtype=dtype),
        )
        format_rows.record_formats(record, x, size, args.formats)
        format_rows.record_reductions(record, pair, x, size, args.formats, k)
        del x, q, qs, stacked, out, xb, cb, sb
    return rows


def _paired_mode(args: argparse.Namespace) -> bool:
    """Whether each op is also timed through ``--vs-path`` (CPU only): the table's extra columns."""
    return torch.device(args.device).type == "cpu" and args.vs_path != "none"


def _print_header(args: argparse.Namespace) -> None:
    dev = torch.device(args.device)
    if dev.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(dev)} - Triton kernels")
    else:
        path = {
            "auto": "the native kernels (kernels/cpu_native.py) where they build, else the compiled / tiled paths",
            "native": "the native kernels (kernels/cpu_native.py)",
            "compiled": "compiled kernels (kernels/cpu_fused.py) from "
            f"{cpu_fused.FUSED_MIN_ELEMS} elements ({cpu_fused.DEQUANTIZE_MIN_ELEMS} for dequantize), "
            "tiles below",
            "tiled": "tiles only",
        }[args.cpu_path]
        print(
            "CPU: timing the CPU path (kernels/cpu.py, bit-identical to the torch reference), not the Triton kernels "
            f"({torch.get_num_threads()} thread(s); {path})"
        )
    print(
        f"input dtype {args.dtype}; bytes moved = bytes read + bytes written (codes, fp32 scales, "
        f"full-precision data), each once; copy = dst.copy_(src) moving the same bytes, same run; "
        f"vs compile = time of torch.compile'd plain torch / ours (> 1: ours faster)"
    )
    old = _paired_mode(args)
    if old:
        print(
            f"old = the CPU path '{args.vs_path}', timed call by call in alternation with ours; x old = median of "
            "the per-pair time ratios old / ours (= the ratio of the shares of copy bandwidth)"
        )
    extra = f" {'old of copy':>11} | {'x old':>6} |" if old else ""
    head = (
        f"| {'op':<30} | {'size':>9} | {'bytes moved':>13} | {'time (us)':>10} | {'GB/s':>8} | {'of copy':>7} "
        f"| {'vs compile':>10} |{extra}"
    )
    print(head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|", flush=True)


def _print_row(r: dict, args: argparse.Namespace) -> None:
    vs = "" if r["vs_compile"] is None else f"{r['vs_compile']:.2f}x"
    line = (
        f"| {r['op']:<30} | {_fmt_bytes(r['size']):>9} | {r['bytes']:>13,} | {r['seconds'] * 1e6:>10.1f} | "
        f"{r['gbps']:>8.2f} | {r['fraction']:>6.0%} | {vs:>10} |"
    )
    if _paired_mode(args):
        of = "" if r["old_fraction"] is None else f"{r['old_fraction']:.1%}"
        x = "" if r["vs_old"] is None else f"{r['vs_old']:.1f}x"
        line += f" {of:>11} | {x:>6} |"
    print(line, flush=True)


def _print_summary(rows: list[dict], args: argparse.Namespace) -> None:
    dev = torch.device(args.device)
    for text in (format_rows.shares_text(rows, _fmt_bytes), format_rows.fused_text(rows, _fmt_bytes)):
        if text:
            print(text)
    big = [r["fraction"] for r in rows if r["op"] != "copy" and r["size"] >= 64 << 20]
    if dev.type == "cuda" and big:
        print(f"lowest fraction of copy bandwidth for sizes >= 64 MiB: {min(big):.0%} (target {TARGET_FRACTION:.0%})")


def _check_device(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--device`` must be one torch can name and this machine has: usage error (exit 2) otherwise."""
    try:
        dev = torch.device(args.device)
    except RuntimeError:
        p.error(f"--device {args.device!r} is not a device; use cpu or cuda (cuda:N for one GPU)")
    if dev.type not in ("cpu", "cuda"):
        p.error(f"--device {args.device}: the benchmark times the CPU path or the Triton kernels; use cpu or cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: torch sees no CUDA device here; use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= (n := torch.cuda.device_count()):
        p.error(f"--device {args.device}: torch sees {n} CUDA device(s) here, cuda:0 to cuda:{n - 1}; name one of them")
    if dev.type == "cpu" and dev.index not in (None, 0):
        p.error(f"--device {args.device}: there is one CPU device; use --device cpu")


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, with argparse's usage error (exit 2) naming the flag, what would hang, crash or time
    nothing: sizes that are not finite and at least one byte (a size of 0 never grows in the x4
    steps of :func:`_sizes`, so the loop would never end), a smallest size above the largest (which
    silently timed the largest alone), and counts below their floor."""
    for name in ("min_kib", "max_mib"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            p.error(f"{flag(name)} must be a finite size > 0, got {value:g}")
    if args.min_kib * 1024 < 1:
        p.error(f"--min-kib {args.min_kib:g} is below one byte; use at least {1 / 1024:g}")
    if args.min_kib > args.max_mib * 1024:
        p.error(
            f"--min-kib {args.min_kib:g} is above --max-mib {args.max_mib:g} (= {args.max_mib * 1024:g} KiB); "
            "lower --min-kib or raise --max-mib"
        )
    require_at_least(p, args, ("k", "threads", "iters"), 1)
    require_at_least(p, args, ("warmup",), 0)
    _check_memory(p, args)


LIVE_FP32_COPIES = 6
"""fp32-sized tensors of the largest size the benchmark holds at once besides the ``--k`` inputs of
the reductions (the input and its fp32 source, a padded copy, codes, an output, a format's
working copy): the estimate :func:`_check_memory` refuses by."""


def _check_memory(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a ``--max-mib`` whose tensors the device cannot hold (before: the allocator's
    traceback or the out-of-memory killer, after the smaller sizes had run)."""
    from ..runner.console import human_bytes
    from ..runner.preflight import host_memory

    dev = torch.device(args.device)
    have = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else host_memory()
    esize = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    need = 4 * (int(args.max_mib * (1 << 20)) // esize) * (args.k + LIVE_FP32_COPIES)
    if need > have:
        p.error(
            f"--max-mib {args.max_mib:g} (with --k {args.k}) needs about {human_bytes(need)} on {dev.type} but it has "
            f"{human_bytes(have)}; lower --max-mib"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--min-kib", type=float, default=64.0, help="smallest input size (KiB)")
    p.add_argument("--max-mib", type=float, default=None, help="largest input size (MiB); 1024 GPU, 64 CPU")
    p.add_argument(
        "--cpu-path",
        default="auto",
        choices=CPU_PATHS,
        help="CPU: the path to time: auto = what ranks run (native kernels where they build); native; "
        "compiled = torch.compile'd kernels (kernels/cpu_fused.py); tiled = the tiles only "
        "(the plain-torch baseline)",
    )
    p.add_argument(
        "--vs-path",
        default="tiled",
        choices=(*CPU_PATHS, "none"),
        help="CPU: also time each op through this path, in alternation with --cpu-path, and print "
        "the speed-up (none: skip)",
    )
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline column")
    p.add_argument(
        "--formats",
        type=format_rows.parse_formats,
        default="all",
        help=f"float formats timed beside INT8 / INT4 (experiments/bench/format_rows.py): all (default), none, or "
        f"some of {', '.join(format_rows.CASES)}",
    )
    p.add_argument("--k", type=int, default=4, help="inputs summed by the reductions (ranks per node)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU intra-op threads (1: on a shared machine a multi-threaded region waits for "
        "its slowest, possibly descheduled, thread, which makes timings noise)",
    )
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--iters", type=int, default=None)
    args = p.parse_args(argv)
    _check_device(p, args)
    cuda = torch.device(args.device).type == "cuda"
    args.max_mib = args.max_mib if args.max_mib is not None else (1024.0 if cuda else 64.0)
    args.warmup = args.warmup if args.warmup is not None else (5 if cuda else 2)
    args.iters = args.iters if args.iters is not None else (20 if cuda else 10)
    check_args(p, args)
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    if torch.device(args.device).type == "cpu":
        torch.set_num_threads(args.threads)
    try:
        _print_header(args)
        rows = bench(args, on_row=lambda r: _print_row(r, args))
        _print_summary(rows, args)
    finally:  # main() is also called in-process by the smoke test
        torch.set_num_threads(threads)
    return rows


def cli() -> NoReturn:
    """The command: :func:`main`, ended by ``launch.command.run_command`` (Ctrl-C or a failed world
    is one ``error:`` line and the shell's exit status, never a traceback)."""
    run_command(main)


if __name__ == "__main__":
    cli()
