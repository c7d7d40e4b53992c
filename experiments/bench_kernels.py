"""Bandwidth of the quantization kernels against a plain copy measured in the same run.

    python -m experiments.bench_kernels                 # GPU: Triton kernels, 64 KiB .. 256 MiB
    python -m experiments.bench_kernels --max-mib 16    # CPU default: the CPU path (kernels/cpu.py)

Why a copy baseline: quantize, dequantize and the fused reduce are memory-bound, so the honest
yardstick is what the same device reaches moving bytes with no arithmetic at all. Each op row is
compared with ``dst.copy_(src)`` moving the same number of bytes (read + written) at that size.

Byte convention: "bytes moved" = bytes the op must read plus bytes it must write, each counted
once (codes, fp32 scales and full-precision tensors alike); GB/s = bytes moved / time / 1e9.
"size" is the full-precision input of one tensor (``n`` elements of ``--dtype``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from zeropp.kernels import (
    QuantizedTensor,
    dequantize,
    dequantize_sum,
    dequantize_sum_requantize,
    quantize,
    quantized_nbytes,
)

TARGET_FRACTION = 0.90
"""Goal on H100/H200: >= 90% of the measured copy bandwidth for sizes >= 64 MiB."""


def _timer(device: torch.device, warmup: int, iters: int) -> Callable[[Callable[[], object]], float]:
    """Median seconds per call: CUDA events around each call on GPU, perf_counter on CPU."""

    def run(fn: Callable[[], object]) -> float:
        for _ in range(warmup):
            fn()
        times = []
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            for _ in range(iters):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
        else:
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return run


def _sizes(min_kib: float, max_mib: float) -> list[int]:
    """Input bytes from min_kib KiB in x4 steps (64 KiB, 256 KiB, ... 256 MiB), ending at max_mib."""
    lo, top = int(min_kib * 1024), int(max_mib * 1024 * 1024)
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


def bench(args: argparse.Namespace) -> list[dict]:
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

    def record(op: str, size: int, nbytes: int, seconds: float) -> None:
        gbps = nbytes / seconds / 1e9
        copy_gbps = nbytes / copy_seconds(nbytes) / 1e9
        rows.append(dict(op=op, size=size, bytes=nbytes, seconds=seconds, gbps=gbps, fraction=gbps / copy_gbps))

    k = args.k
    for size in _sizes(args.min_kib, args.max_mib):
        n = max(1, size // esize)
        x = torch.randn(n, device=device).to(dtype)  # [n]
        record("copy", size, 2 * n * esize, copy_seconds(2 * n * esize))
        for bits, gs in ((8, 512), (4, 128)):
            qb = quantized_nbytes(1, n, bits, gs)  # codes + scales of one tensor
            q = quantize(x, bits, gs)
            record(f"quantize int{bits} g{gs}", size, n * esize + qb, timeit(lambda: quantize(x, bits, gs)))
            out = torch.empty(n, dtype=dtype, device=device)
            record(f"dequantize int{bits} g{gs}", size, qb + n * esize, timeit(lambda: dequantize(q, out=out)))
        if device.type == "cuda":  # the torch reference's Philox is ~50x slower than its rounding
            qb = quantized_nbytes(1, n, 4, 128)  # stochastic rounding adds Philox work, not bytes
            record("quantize int4 g128 stochastic", size, n * esize + qb,
                   timeit(lambda: quantize(x, 4, 128, stochastic=True, seed=1)))
        gs = 128
        qs = [quantize(torch.randn(n, device=device), 4, gs) for _ in range(k)]
        stacked = QuantizedTensor(torch.stack([q.codes for q in qs]), torch.stack([q.scales for q in qs]), n, 4, gs)
        qb = quantized_nbytes(1, n, 4, gs)
        record(f"fused reduce int4 g{gs} k{k}", size, (k + 1) * qb,
               timeit(lambda: dequantize_sum_requantize(stacked, 4)))
        out = torch.empty(n, dtype=dtype, device=device)
        record(f"dequantize_sum int4 g{gs} k{k}", size, k * qb + n * esize,
               timeit(lambda: dequantize_sum(stacked, out=out)))
        del x, q, qs, stacked, out
    return rows


def _print(rows: list[dict], args: argparse.Namespace) -> None:
    dev = torch.device(args.device)
    if dev.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(dev)} - Triton kernels")
    else:
        print("CPU: timing the CPU path (kernels/cpu.py, bit-identical to the torch reference), not the Triton kernels "
              f"({torch.get_num_threads()} thread(s))")
    print(f"input dtype {args.dtype}; bytes moved = bytes read + bytes written (codes, fp32 scales, "
          f"full-precision data), each once; copy = dst.copy_(src) moving the same bytes, same run")
    head = f"| {'op':<30} | {'size':>9} | {'bytes moved':>12} | {'time (us)':>10} | {'GB/s':>8} | {'of copy':>7} |"
    print(head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    for r in rows:
        print(f"| {r['op']:<30} | {_fmt_bytes(r['size']):>9} | {r['bytes']:>12,} | {r['seconds'] * 1e6:>10.1f} | "
              f"{r['gbps']:>8.2f} | {r['fraction']:>6.0%} |")
    big = [r["fraction"] for r in rows if r["op"] != "copy" and r["size"] >= 64 << 20]
    if dev.type == "cuda" and big:
        print(f"lowest fraction of copy bandwidth for sizes >= 64 MiB: {min(big):.0%} "
              f"(target {TARGET_FRACTION:.0%})")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--min-kib", type=float, default=64.0, help="smallest input size (KiB)")
    p.add_argument("--max-mib", type=float, default=None, help="largest input size (MiB); 256 GPU, 16 CPU")
    p.add_argument("--k", type=int, default=4, help="inputs summed by the reductions (ranks per node)")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU intra-op threads (1: on a shared machine a multi-threaded region waits for "
                        "its slowest, possibly descheduled, thread, which makes timings noise)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--iters", type=int, default=None)
    args = p.parse_args(argv)
    cuda = torch.device(args.device).type == "cuda"
    args.max_mib = args.max_mib if args.max_mib is not None else (256.0 if cuda else 16.0)
    args.warmup = args.warmup if args.warmup is not None else (5 if cuda else 2)
    args.iters = args.iters if args.iters is not None else (20 if cuda else 10)
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    if torch.device(args.device).type == "cpu":
        torch.set_num_threads(args.threads)
    try:
        rows = bench(args)
        _print(rows, args)
    finally:
        torch.set_num_threads(threads)  # main() is also called in-process by the smoke test
    return rows


if __name__ == "__main__":
    main()
