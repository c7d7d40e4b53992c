"""The float formats' rows of ``experiments.bench_kernels``: quantize and dequantize of fp8, MXFP8,
MXFP6, MXFP4, MXINT8 and NVFP4 (and MXFP4 with stochastic rounding), each against a copy of the
same bytes.

    python -m experiments.bench_kernels                     # GPU: the int rows, then these
    python -m experiments.bench_kernels --formats no        # the int rows only
    python -m experiments.bench_kernels --device cpu --formats yes   # CPU: format_ops' CPU path

The calls go through ``kernels.format_ops``, which runs CUDA tensors on the Triton kernels of
``kernels/triton_formats.py`` and CPU tensors on the CPU path (the native kernels where they exist,
else the pure-torch reference). Bytes moved: the full-precision input (or output) plus the wire
bytes of the quantized row (codes, block scales, nvfp4's tensor scale), each counted once.
There is no ``torch.compile`` column for these rows: no plain torch formulation of the formats
does the same work (a ``float8`` cast rounds and saturates differently and has no 6- or 4-bit
types).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Protocol

import torch

from zeropp.kernels import format_ops
from zeropp.kernels.format_layout import FormatTensor

CASES: tuple[tuple[str, str, str, int, bool], ...] = (
    ("fp8 e4m3 g128", "fp8", "e4m3", 128, False),
    ("mxfp8 e4m3", "mx", "e4m3", 32, False),
    ("mxfp6 e3m2", "mx", "e3m2", 32, False),
    ("mxfp4", "mx", "e2m1", 32, False),
    ("mxfp4 stochastic", "mx", "e2m1", 32, True),
    ("mxint8", "mx", "int8", 32, False),
    ("nvfp4", "nvfp4", "e2m1", 16, False),
)
"""``(row label, scheme, element format, group size, stochastic)`` of each benchmarked format."""

FORMATS_CHOICES = ("auto", "yes", "no")
"""``--formats``: auto = on CUDA only (the Triton kernels), yes / no = always / never."""


class Record(Protocol):
    def __call__(self, op: str, size: int, nbytes: int, fn: Callable[[], object] | None) -> None: ...


def wanted(choice: str, device: torch.device) -> bool:
    """Whether ``--formats choice`` benchmarks the formats on ``device``."""
    return choice == "yes" or (choice == "auto" and device.type == "cuda")


def quantize(x: torch.Tensor, scheme: str, elem: str, group_size: int, stochastic: bool) -> FormatTensor:
    """One row of ``x`` in the format, through ``format_ops`` (the device decides the kernels)."""
    if scheme == "fp8":
        return format_ops.quantize_fp8(x, elem, group_size, stochastic=stochastic, seed=1)
    if scheme == "mx":
        return format_ops.quantize_mx(x, elem, stochastic=stochastic, seed=1)
    return format_ops.quantize_nvfp4(x, stochastic=stochastic, seed=1)


def record_formats(record: Record, x: torch.Tensor, size: int) -> None:
    """Time quantize and dequantize of every case on ``x`` (one row) through ``record``."""
    n, esize = x.numel(), x.element_size()
    for label, scheme, elem, gs, stochastic in CASES:
        q = quantize(x, scheme, elem, gs, stochastic)
        record(
            f"quantize {label}",
            size,
            n * esize + q.nbytes,
            functools.partial(quantize, x, scheme, elem, gs, stochastic),
        )
        if not stochastic:  # a stochastic row's codes dequantize as the nearest row's do
            out = torch.empty(n, dtype=x.dtype, device=x.device)
            record(
                f"dequantize {label}",
                size,
                q.nbytes + n * esize,
                functools.partial(format_ops.dequantize_format, q, out=out),
            )
