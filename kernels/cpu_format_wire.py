"""The float formats' CPU kernels on wire rows ``uint8 [rows, wire_bytes]`` (``format_layout``'s
layout): :func:`encode_wire` quantizes straight into new wire rows, and the reductions over
received rows, :func:`dequantize_sum_wire` and :func:`dequantize_sum_requantize_wire`, are
``FormatCodec``'s CPU path. Same library, build and bit-identity rules as ``cpu_formats.py``.

The reductions over received wire rows (:func:`dequantize_sum_wire`, :func:`dequantize_sum_requantize_wire`,
``FormatCodec``'s CPU path) read the k sources' rows in place, tile by tile: each source's codes
decoded into an L1 tile and added to an fp32 accumulator that starts at +0.0, in source order, so
the sum is bit for bit the codecs' generic one (``Codec.dequantize_sum``); the tile is then stored
in the output dtype, or quantized by the same encoder as :func:`encode_wire` (nvfp4 first sums a
whole row into a reused scratch: its tensor scale needs the row's absmax before any block).
"""

from __future__ import annotations

import threading

import torch

from . import cpu_native, format_reference
from .cpu_format_library import DTYPES, ELEMENTS, SCHEMES, check_rc, library, native_enabled, quantize_into
from .format_layout import (
    check_format_args,
    check_requantize_args,
    check_scale_rule,
    code_bytes,
    pack,
    received_rows,
    wire_bytes,
)
from .layout import check_float_dtype, num_groups, output_buffer


def encode_wire(
    x: torch.Tensor, scheme: str, elem: str, group_size: int, scale_rule: str, rows: int, stochastic: bool, seed: int
) -> torch.Tensor:
    """``format_layout.pack`` of ``quantize_<scheme>(x, ...)``, with the codes written by the kernel
    straight into the wire rows ``uint8 [rows, wire_bytes]`` (no codes tensor, no concatenation).
    MX block scales (bytes) go there directly too; fp8's fp32 scales and nvfp4's fp32 tensor scale
    sit at byte offsets an fp32 store may not use, so they are written aside and copied in (one
    scale per group or per row). The reference packs where the kernels are unavailable."""
    if not native_enabled():
        q = getattr(format_reference, f"quantize_{scheme}_ref")
        kw = {"scale_rule": scale_rule} if scheme == "mx" else {}
        args = (x, elem, group_size) if scheme == "fp8" else ((x, elem) if scheme == "mx" else (x,))
        return pack(q(*args, rows=rows, stochastic=stochastic, seed=seed, **kw))
    if scheme == "mx":
        check_scale_rule(scale_rule)
    cols, seed = check_format_args(x, scheme, elem, group_size, rows, seed)
    if x.device.type != "cpu":
        raise ValueError(f"zeropp.kernels.cpu_format_wire takes CPU tensors, got one on {x.device}")
    x2 = x.reshape(rows, cols)
    if cols > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    wire = _WireOut(rows, scheme, elem, cols, group_size)
    quantize_into(
        x2, scheme, elem, group_size, scale_rule == "round_up", stochastic, seed, wire.codes, wire.scales, wire.tscales
    )
    return wire.finish()


class _WireOut:
    """New wire rows ``uint8 [rows, wire_bytes]`` and where a quantize kernel writes into them: the
    codes (a view), the block scales (mx / nvfp4 bytes: a view; fp8's fp32: aside, since they sit at
    byte offsets an fp32 store may not use) and nvfp4's fp32 tensor scales (aside). :meth:`finish`
    copies what was written aside into the rows and returns them."""

    def __init__(self, rows: int, scheme: str, elem: str, cols: int, group_size: int) -> None:
        self.cb, g = code_bytes(cols, elem, group_size), num_groups(cols, group_size)
        self.g = g
        self.buf = cpu_native.empty(rows, wire_bytes(scheme, elem, cols, group_size), dtype=torch.uint8)
        self.fp8 = scheme == "fp8"
        self.codes = self.buf[:, : self.cb]
        self.scales = torch.empty(rows, g, dtype=torch.float32) if self.fp8 else self.buf[:, self.cb : self.cb + g]
        self.tscales = torch.empty(rows, 1, dtype=torch.float32) if scheme == "nvfp4" else None

    def finish(self) -> torch.Tensor:
        if self.fp8:
            self.buf[:, self.cb :].copy_(self.scales.view(torch.uint8))
        if self.tscales is not None:
            self.buf[:, self.cb + self.g :].copy_(self.tscales.view(torch.uint8))
        return self.buf


def _received(buf: torch.Tensor, scheme: str, elem: str, cols: int, group_size: int) -> tuple[torch.Tensor, int, int]:
    """``format_layout.received_rows``, on the CPU."""
    if buf.device.type != "cpu":
        raise ValueError(f"zeropp.kernels.cpu_format_wire takes CPU tensors, got one on {buf.device}")
    return received_rows(buf, scheme, elem, cols, group_size)


def _wire_args(buf: torch.Tensor, cols: int) -> tuple[int, ...]:
    """The entry points' first arguments for received rows ``[k, rows, B]``: pointer, k, the
    sources' and rows' strides (bytes), rows, cols."""
    return (buf.data_ptr(), buf.shape[0], buf.stride(0), buf.stride(1), buf.shape[1], cols)


def dequantize_sum_wire(
    buf: torch.Tensor,
    scheme: str,
    elem: str,
    cols: int,
    group_size: int,
    *,
    out: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Received wire rows ``uint8 [k, rows, wire_bytes]`` -> their sum over k as ``[rows, cols]``
    (``dtype``, or into ``out``, contiguous, whose dtype wins), read in place in one pass: bit for
    bit the sum of the k rows' dequantizations, added in fp32 in order 0..k-1 from zero, then
    rounded once (what ``Codec.dequantize_sum`` computes). Callers check :func:`native_enabled`."""
    buf, cb, g = _received(buf, scheme, elem, cols, group_size)
    rows = buf.shape[1]
    if out is None:
        check_float_dtype(dtype, "output")
        dst = cpu_native.empty(rows, cols, dtype=dtype)
    else:
        dst = output_buffer(out, rows, cols, dtype, buf.device)  # checked contiguous
    lib = library()
    assert lib is not None, "callers check native_enabled() first"
    check_rc(
        lib.zf_dequantize_sum(
            *_wire_args(buf, cols),
            SCHEMES[scheme],
            ELEMENTS[elem],
            group_size,
            cb,
            g,
            dst.data_ptr(),
            DTYPES[dst.dtype],
        ),
        "dequantize_sum",
    )
    return dst


def dequantize_sum_requantize_wire(
    buf: torch.Tensor,
    scheme: str,
    elem: str,
    out_elem: str,
    cols: int,
    group_size: int,
    scale_rule: str,
    stochastic: bool,
    seed: int,
) -> torch.Tensor:
    """Received wire rows at ``elem`` -> their sum as new wire rows ``uint8 [rows, wire_bytes]`` at
    ``out_elem``: bit for bit :func:`encode_wire` of :func:`dequantize_sum_wire`'s fp32 sum (same
    seed), without the fp32 sum in memory (nvfp4 keeps one summed row: its tensor scale needs the
    row's absmax first). Callers check :func:`native_enabled`."""
    buf, cb, g = _received(buf, scheme, elem, cols, group_size)
    seed = check_requantize_args(scheme, out_elem, scale_rule, seed)
    rows = buf.shape[1]
    wire = _WireOut(rows, scheme, out_elem, cols, group_size)
    lib = library()
    assert lib is not None, "callers check native_enabled() first"
    check_rc(
        lib.zf_dequantize_sum_requantize(
            *_wire_args(buf, cols),
            SCHEMES[scheme],
            ELEMENTS[elem],
            ELEMENTS[out_elem],
            group_size,
            cb,
            g,
            int(scale_rule == "round_up"),
            int(stochastic),
            seed,
            wire.codes.data_ptr(),
            wire.codes.stride(0),
            wire.scales.data_ptr(),
            wire.scales.stride(0),
            0 if wire.tscales is None else wire.tscales.data_ptr(),
            0 if wire.tscales is None else wire.tscales.stride(0),
            _row_scratch(g * 16).data_ptr() if scheme == "nvfp4" else 0,
        ),
        "dequantize_sum_requantize",
    )
    return wire.finish()


_SCRATCH = threading.local()


def _row_scratch(n: int) -> torch.Tensor:
    """This thread's fp32 scratch of at least ``n`` elements (nvfp4's summed row), kept and grown
    as needed. Why kept: a fresh large buffer faults in each of its pages on first write, which
    measured slower than the whole re-quantization (64 MiB: ~45 ms against ~50 ms of work), and
    qgZ reduces rows of the same length at every step."""
    buf = getattr(_SCRATCH, "row", None)
    if buf is None or buf.numel() < n:
        buf = _SCRATCH.row = cpu_native.empty(max(n, 1), dtype=torch.float32)
    return buf
