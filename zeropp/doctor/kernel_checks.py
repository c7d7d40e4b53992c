"""The kernels on this machine: the native CPU build (``kernels/cpu_native.py``) and, on CUDA, the
Triton kernels, each bit for bit against ``kernels/reference.py`` on a few awkward cases; on CUDA
also their GB/s against a device memory copy at 64 MiB.

The cases are few on purpose (the doctor must stay quick): a lone element, a row shorter than a
block, rows that end in a partial block with a non-power-of-two group, zero / NaN / Inf blocks,
INT8 and INT4, fp32 and bf16, round to nearest and stochastic, and each op (quantize,
dequantize, the k-way dequantize-sum, and its re-quantization). The reference always runs on CPU
copies, so a device's different arithmetic (fused multiply-adds, flushed subnormals) shows.
The test suite covers far more (``tests/{unit,e2e,gpu}/test_kernels*.py``).
"""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from zeropp.kernels import (
    QuantizedTensor,
    cpu_adamw,
    cpu_native,
    dequantize,
    dequantize_sum,
    dequantize_sum_requantize,
    quantize,
    quantized_nbytes,
    timing,
)
from zeropp.kernels import reference as ref

from . import system
from .result import NO_CUDA, CheckResult, DoctorOptions, failed, passed, skipped

CASES: tuple[tuple[tuple[int, ...], int, int], ...] = (
    ((1,), 1, 64),
    ((7,), 1, 64),
    ((17, 257), 17, 100),
    ((3, 1000), 1, 64),
)
"""(shape, rows, group size): a lone element, less than a block, 17 rows ending in a partial
block of a non-power-of-two group, and one row of several blocks."""

SEED = 2**40 + 12345
"""Stochastic rounding seed beyond 32 bits (the whole Philox key is used)."""


def awkward(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Gaussian data with exact zeros, a whole zero block, a -0.0 run, an Inf and a NaN (where the
    tensor is big enough to hold them)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3
    flat = x.view(-1)
    flat[::101] = 0.0
    if flat.numel() > 600:
        flat[300:400] = 0.0
        flat[410:420] = -0.0
        flat[500] = float("inf")
        flat[555] = float("nan")
    return x.to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape, NaN positions, values and signs of zero (NaN payloads may differ, as
    torch's own casts do not fix them)."""
    a, b = a.cpu(), b.cpu()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    a0, b0 = torch.where(nan_a, torch.zeros_like(a), a), torch.where(nan_b, torch.zeros_like(b), b)
    return torch.equal(nan_a, nan_b) and torch.equal(a0, b0) and torch.equal(torch.signbit(a0), torch.signbit(b0))


def same_quantized(a: QuantizedTensor, b: QuantizedTensor) -> bool:
    return (a.cols, a.bits, a.group_size) == (b.cols, b.bits, b.group_size) and (
        same_bits(a.codes, b.codes) and same_bits(a.scales, b.scales)
    )


def _on(q: QuantizedTensor, device: torch.device) -> QuantizedTensor:
    return QuantizedTensor(q.codes.to(device), q.scales.to(device), q.cols, q.bits, q.group_size)


def _stack(qs: list[QuantizedTensor]) -> QuantizedTensor:
    q0 = qs[0]
    return QuantizedTensor(
        torch.stack([q.codes for q in qs]), torch.stack([q.scales for q in qs]), q0.cols, q0.bits, q0.group_size
    )


def mismatches(
    device: torch.device, impl: str, cases: Optional[Sequence[tuple[tuple[int, ...], int, int]]] = None
) -> list[str]:
    """Every case on which the kernels of ``impl`` ("torch": the CPU path, "triton") on
    ``device`` differ from the reference by a bit; empty when they agree everywhere.
    ``cases``: (shape, rows, group size) triples, default :data:`CASES`."""
    bad: list[str] = []
    for (shape, rows, gs), bits, dtype, stochastic in itertools.product(
        CASES if cases is None else cases, (8, 4), (torch.float32, torch.bfloat16), (False, True)
    ):
        if stochastic and dtype != torch.float32:
            continue  # one dtype suffices for the Philox stream
        case = f"{'x'.join(map(str, shape))} rows={rows} g={gs} int{bits} {str(dtype)[6:]}" + (
            " stochastic" if stochastic else ""
        )
        xs = [awkward(shape, dtype, seed=s) for s in range(3)]
        refs = [ref.quantize_ref(x, bits, gs, rows=rows, stochastic=stochastic, seed=SEED) for x in xs]
        got = [quantize(x.to(device), bits, gs, rows=rows, stochastic=stochastic, seed=SEED, impl=impl) for x in xs]
        if not all(same_quantized(g, r) for g, r in zip(got, refs)):
            bad.append(f"quantize {case}")
            continue
        if not same_bits(
            dequantize(_on(refs[0], device), dtype=dtype, impl=impl), ref.dequantize_ref(refs[0], dtype=dtype)
        ):
            bad.append(f"dequantize {case}")
        stacked = _stack(refs)
        if not same_bits(
            dequantize_sum(_on(stacked, device), dtype=dtype, impl=impl), ref.dequantize_sum_ref(stacked, dtype=dtype)
        ):
            bad.append(f"dequantize_sum {case}")
        requant = dequantize_sum_requantize(_on(stacked, device), bits, gs, stochastic=stochastic, seed=SEED, impl=impl)
        if not same_quantized(
            requant, ref.dequantize_sum_requantize_ref(stacked, bits, gs, stochastic=stochastic, seed=SEED)
        ):
            bad.append(f"dequantize_sum_requantize {case}")
    return bad


def bit_exact_row(name: str, prefix: str, bad: list[str], **data: object) -> CheckResult:
    """The row for a kernel comparison: ``prefix`` (what was done) then the verdict on ``bad``
    (the :func:`mismatches`)."""
    if bad:
        return failed(
            name,
            f"{prefix}NOT bit-exact: {len(bad)} case(s) differ from kernels/reference.py, first: {bad[0]}; "
            "report it with this output (the quantized collectives would not match other devices)",
            mismatches=bad,
            **data,
        )
    return passed(name, f"{prefix}bit-exact against kernels/reference.py on {len(CASES)} awkward shapes", **data)


def _built(name: str, kernel: Any, verb: str, fallback: str) -> Path | CheckResult:
    """The library file of a native ``kernel`` module (``cpu_native``, ``cpu_adamw``: ``load()``,
    ``library()``, ``FAILED``), built or loaded from the cache; or the failed row saying why, what
    to install (``verb``: how the row says it does not build) and what runs instead (``fallback``)."""
    try:
        _, path = kernel.load()
    except Exception as err:
        return failed(
            name,
            f"{verb} ({type(err).__name__}: {str(err).strip()[:300]}); install g++ or set CXX to a C++17 "
            f"compiler ({fallback})",
            error=f"{type(err).__name__}: {err}",
        )
    if kernel.library() is None:
        return failed(name, f"built at {path} but not usable in this process: {kernel.FAILED}", library=str(path))
    return Path(path)


def check_native_cpu(options: DoctorOptions) -> CheckResult:
    """The native CPU kernels build (or load from the cache) and agree with the reference bit for
    bit. A build failure is a failed row: CPU ranks still run, on the slower paths."""
    name = "native CPU kernels"
    if not cpu_native.ENABLED:
        return skipped(name, "skipped: ZEROPP_CPU_NATIVE=0 turns them off in this environment")
    path = _built(name, cpu_native, "do not build here", "CPU ranks fall back to the slower torch path")
    if isinstance(path, CheckResult):
        return path
    bad = mismatches(torch.device("cpu"), "torch")
    return bit_exact_row(name, "built and loaded; ", bad, library=str(path))


def check_cpu_adamw(options: DoctorOptions) -> CheckResult:
    """The native CPU AdamW (``kernels/cpu_adamw.py``) builds (or loads from the cache) and, where it
    gives torch's single-tensor AdamW bits on this machine, is what the in-memory optimizer runs
    (``kernel="exact"``); the offload tiers run it either way (``native``). A build failure is a
    failed row (the optimizers then run torch's kernels: the same results, more CPU time); a kernel
    whose bits differ from torch's here (torch's square root not reproduced) is a pass that says
    the in-memory optimizer runs torch's ops instead."""
    name = "CPU AdamW"
    path = _built(
        name, cpu_adamw, "does not build here", "the optimizers fall back to torch's AdamW: same results, slower"
    )
    if isinstance(path, CheckResult):
        return path
    if not cpu_adamw.reproduces_reference():
        return passed(
            name,
            "built and loaded (the offload tiers' 'native'); its bits differ from torch's single-tensor AdamW here "
            "(torch's square root is not reproduced), so the in-memory optimizer of CPU ranks runs torch's own ops "
            "(same results, slower)",
            library=str(path),
            exact=False,
        )
    return passed(
        name,
        "built and loaded; bit-exact with torch's single-tensor AdamW, so every optimizer whose state is on the "
        "CPU runs it (CPU ranks, the offload tiers)",
        library=str(path),
        exact=True,
    )


def check_triton(options: DoctorOptions) -> CheckResult:
    """The Triton kernels compile on this GPU and agree with the reference bit for bit."""
    name = "Triton kernels"
    if not system.cuda_usable():
        return skipped(name, NO_CUDA)
    if system.triton_version() is None:
        return failed(name, "triton is not importable: install it (pip install triton) to run the GPU kernels")
    if os.environ.get("TRITON_INTERPRET") == "1":
        return failed(name, "TRITON_INTERPRET=1 is set: the interpreter replaces the compiled kernels; unset it")
    device = torch.device("cuda", torch.cuda.current_device())
    t0 = time.perf_counter()
    bad = mismatches(device, "triton")
    torch.cuda.synchronize(device)
    data = {"device": torch.cuda.get_device_name(device), "seconds_with_compile": round(time.perf_counter() - t0, 2)}
    return bit_exact_row(name, f"compiled on {data['device']}; ", bad, **data)


BANDWIDTH_BYTES = 64 << 20
"""Size of the fp32 input of the bandwidth rows (64 MiB)."""


def cuda_timer(fn: Callable[[], object], warmup: int = 3, iters: int = 20) -> float:
    """Median seconds of one call of ``fn`` on the current CUDA stream, by CUDA events."""
    return timing.median_seconds(fn, device="cuda", warmup=warmup, iters=iters)


def bandwidth(
    device: torch.device, nbytes: int = BANDWIDTH_BYTES, timer: Optional[Callable] = None
) -> dict[str, float]:
    """GB/s (bytes read + written / s / 1e9) of a device copy of ``nbytes``, of INT8 quantize of
    ``nbytes`` of fp32 and of dequantize back to fp32, each as measured here."""
    timer = timer or cuda_timer
    n = nbytes // 4
    x = torch.randn(n, device=device)
    dst = torch.empty_like(x)
    gs = 512
    q = quantize(x, 8, gs)
    qbytes = quantized_nbytes(1, n, 8, gs)
    copy_s = timer(lambda: dst.copy_(x))
    quant_s = timer(lambda: quantize(x, 8, gs, out=q))
    deq_s = timer(lambda: dequantize(q, out=dst))
    gbs = {
        "copy": 2 * nbytes / copy_s / 1e9,
        "quantize_int8": (nbytes + qbytes) / quant_s / 1e9,
        "dequantize_int8": (nbytes + qbytes) / deq_s / 1e9,
    }
    return {k: round(v, 1) for k, v in gbs.items()}


def check_bandwidth(options: DoctorOptions) -> CheckResult:
    """The Triton kernels' GB/s at 64 MiB against a device memory copy (informative: a pass unless
    the measurement fails)."""
    name = "kernel GB/s"
    if not system.cuda_usable():
        return skipped(name, NO_CUDA)
    if options.quick:
        return skipped(name, "skipped: --quick")
    gbs = bandwidth(torch.device("cuda", torch.cuda.current_device()))
    c = gbs["copy"]
    detail = (
        f"64 MiB fp32: copy {c:.0f} GB/s; INT8 quantize {gbs['quantize_int8']:.0f} GB/s "
        f"({100 * gbs['quantize_int8'] / c:.0f}% of copy), dequantize {gbs['dequantize_int8']:.0f} GB/s "
        f"({100 * gbs['dequantize_int8'] / c:.0f}% of copy)"
    )
    return passed(name, detail, gb_per_s=gbs, bytes=BANDWIDTH_BYTES)
