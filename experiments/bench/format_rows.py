"""The float formats' rows of ``experiments.bench_kernels``: quantize and dequantize of fp8, MXFP8,
MXFP6, MXFP4, MXINT8 and NVFP4 (and MXFP4 with stochastic rounding), each against a copy of the
same bytes; then the codecs' reductions over ``--k`` received wire rows (``dequantize_sum``, and
``fused reduce``: ``dequantize_sum_requantize`` to the same format, qgZ's intra-node hop), each
fused (``FormatCodec``'s) and generic (``Codec``'s unfused default sum, then ``encode``; the row
suffixed ``generic``),
timed in alternation call by call, with the median per-pair speed-up printed after the table.

    python -m experiments.bench_kernels                           # the int rows, then these
    python -m experiments.bench_kernels --formats none            # the int rows only
    python -m experiments.bench_kernels --formats mxfp4,nvfp4     # some of them

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
from typing import Any, Protocol

import torch

from zeropp.comm.codec_base import Codec, generic_sum_requantize
from zeropp.comm.format_codecs import FormatCodec, format_codec
from zeropp.kernels import format_ops
from zeropp.kernels.format_layout import ELEMENTS, FormatTensor

CASES: dict[str, tuple[str, str, str, int, bool]] = {
    "fp8": ("fp8 e4m3 g512", "fp8", "e4m3", 512, False),
    "fp8_e5m2": ("fp8 e5m2 g512", "fp8", "e5m2", 512, False),
    "mxfp8": ("mxfp8 e4m3", "mx", "e4m3", 32, False),
    "mxfp6": ("mxfp6 e3m2", "mx", "e3m2", 32, False),
    "mxfp4": ("mxfp4", "mx", "e2m1", 32, False),
    "mxfp4_sr": ("mxfp4 stochastic", "mx", "e2m1", 32, True),
    "mxint8": ("mxint8", "mx", "int8", 32, False),
    "nvfp4": ("nvfp4", "nvfp4", "e2m1", 16, False),
}
"""``--formats`` name -> ``(row label, scheme, element format, group size, stochastic)``. fp8 takes
INT8's group size (512), so the two move the same bytes."""

FORMAT_TARGET = 0.5
"""Goal on CPU: each format's quantize / dequantize reaches at least half of the INT8 op's share of
copy bandwidth at the same size."""

INT8_LABEL = "int8 g512"
"""The label of the INT8 rows of ``bench_kernels`` the formats are compared with."""


def parse_formats(value: str) -> list[str]:
    """``--formats``: ``all``, ``none`` or comma-separated names of :data:`CASES` (argparse type)."""
    if value == "all":
        return list(CASES)
    if value == "none":
        return []
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown or not names:
        import argparse

        raise argparse.ArgumentTypeError(
            f"unknown format(s) {', '.join(unknown) or repr(value)}; use all, none or some of {', '.join(CASES)}"
        )
    return names


class Record(Protocol):
    def __call__(
        self,
        op: str,
        size: int,
        nbytes: int,
        fn: Callable[[], object] | None,
        *,
        seconds: float | None = ...,
        **extra: Any,
    ) -> None: ...


Pair = Callable[[Callable[[], object], Callable[[], object]], tuple[float, float, float]]
"""Times a fused and a generic call: (seconds fused, seconds generic, speed-up generic / fused)."""


def quantize(x: torch.Tensor, scheme: str, elem: str, group_size: int, stochastic: bool) -> FormatTensor:
    """One row of ``x`` in the format, through ``format_ops`` (the device decides the kernels)."""
    if scheme == "fp8":
        return format_ops.quantize_fp8(x, elem, group_size, stochastic=stochastic, seed=1)
    if scheme == "mx":
        return format_ops.quantize_mx(x, elem, stochastic=stochastic, seed=1)
    return format_ops.quantize_nvfp4(x, stochastic=stochastic, seed=1)


def record_formats(record: Record, x: torch.Tensor, size: int, names: list[str]) -> None:
    """Time quantize and dequantize of the cases ``names`` on ``x`` (one row) through ``record``."""
    n, esize = x.numel(), x.element_size()
    for name in names:
        label, scheme, elem, gs, stochastic = CASES[name]
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


def case_codec(scheme: str, elem: str) -> tuple[FormatCodec, int]:
    """The codec that sends ``elem`` in kernel scheme ``scheme``, and its code width."""
    width = ELEMENTS[elem].bits
    if scheme == "mx" and elem == "int8":
        return format_codec("mxint"), width
    fields = {"fp8_format": elem} if width == 8 else ({"fp6_format": elem} if width == 6 else {})
    return format_codec(scheme, **fields), width


def record_reductions(record: Record, pair: Pair, x: torch.Tensor, size: int, names: list[str], k: int) -> None:
    """The cases ``names``' reductions over ``k`` received rows of ``x.numel()`` elements each
    (one wire row per source), fused and generic: ``dequantize_sum`` into ``x``'s dtype (nearest
    cases) and ``fused reduce`` back to the same format (stochastic cases with a seed). None where
    no fused kernel runs (the native CPU kernels off): the pair would time the generic path twice."""
    n, esize = x.numel(), x.element_size()
    for name in names:
        label, scheme, elem, gs, stochastic = CASES[name]
        codec, bits = case_codec(scheme, elem)
        seed = 1 if stochastic else None
        buf = torch.stack(
            [codec.encode(torch.randn_like(x, dtype=torch.float32), bits, gs, rows=1, seed=None) for _ in range(k)]
        )
        if not codec.fuses(buf):  # (e.g. --cpu-path compiled: the native kernels are off) nothing to compare
            continue
        wb = buf.shape[-1]
        calls = [
            (
                f"fused reduce {label} k{k}",
                (k + 1) * wb,
                functools.partial(codec.dequantize_sum_requantize, buf, n, bits, gs, out_bits=bits, seed=seed),
                functools.partial(generic_sum_requantize, codec, buf, n, bits, gs, out_bits=bits, seed=seed),
            )
        ]
        if not stochastic:
            calls.append(
                (
                    f"dequantize_sum {label} k{k}",
                    k * wb + n * esize,
                    functools.partial(codec.dequantize_sum, buf, n, bits, gs, dtype=x.dtype),
                    functools.partial(Codec.dequantize_sum, codec, buf, n, bits, gs, dtype=x.dtype),
                )
            )
        for op, nbytes, fused, generic in calls:
            sf, sg, speedup = pair(fused, generic)
            record(op, size, nbytes, None, seconds=sf, vs_generic=speedup)
            record(f"{op} generic", size, nbytes, None, seconds=sg)


def fused_text(rows: list[dict], size_text: Callable[[int], str]) -> str:
    """The fused reductions' speed-ups over the generic path (median per-pair ratio), per size."""
    lines = [
        f"  {r['op']:<34} {size_text(r['size']):>9}: {r['vs_generic']:>5.2f}x generic ({r['fraction']:.0%} of copy)"
        for r in rows
        if r.get("vs_generic") is not None
    ]
    if not lines:
        return ""
    return "\n".join(
        ["float formats' reductions, fused / generic (median of per-pair time ratios generic / fused)", *lines]
    )


def format_shares(rows: list[dict]) -> list[tuple[str, int, float, float]]:
    """``(op, size, share of copy, ratio to the INT8 op's share)`` of every format row that has an
    INT8 row of the same kind (quantize / dequantize) and size."""
    labels = {label for label, *_ in CASES.values()}
    int8 = {(r["op"].split()[0], r["size"]): r["fraction"] for r in rows if r["op"].endswith(INT8_LABEL)}
    out = []
    for r in rows:
        kind, _, label = r["op"].partition(" ")
        if label in labels and (kind, r["size"]) in int8:
            out.append((r["op"], r["size"], r["fraction"], r["fraction"] / int8[(kind, r["size"])]))
    return out


def shares_text(rows: list[dict], size_text: Callable[[int], str]) -> str:
    """The formats' shares against INT8's at the largest size measured ("" when none)."""
    shares = format_shares(rows)
    if not shares:
        return ""
    top = max(size for _, size, _, _ in shares)
    lines = [
        f"float formats at {size_text(top)}: share of copy bandwidth as a fraction of the INT8 op's "
        f"(quantize / dequantize {INT8_LABEL}; target >= {FORMAT_TARGET:.0%})"
    ]
    for op, size, frac, ratio in shares:
        if size == top:
            mark = "" if ratio >= FORMAT_TARGET else "  below target"
            lines.append(f"  {op:<26} {frac:>6.1%} of copy = {ratio:>5.0%} of INT8's{mark}")
    return "\n".join(lines)
