"""The float and microscaling codecs: schemes ``fp8``, ``mx``, ``mxint`` and ``nvfp4`` on the
formats of ``zeropp.kernels`` (``format_layout.py`` the wire rows, ``format_ops.py`` the kernels).

One :class:`FormatCodec` per scheme and per setting of the spec's format fields
(``fp8_format``, ``fp6_format``, ``mx_scale``): :meth:`FormatCodec.for_spec` returns the variant
(built once per setting), and each variant maps a code width to its element format, so the
codec methods keep the ``(bits, group_size)`` signature every collective calls:

=========  ================================  =====================================
scheme     bits -> element                   group size
=========  ================================  =====================================
``fp8``    8 -> ``fp8_format``               any (one fp32 scale per group)
``mx``     8 -> ``fp8_format``, 6 ->         32 (one E8M0 scale per block)
           ``fp6_format``, 4 -> e2m1
``mxint``  8 -> int8 (MXINT8)                32
``nvfp4``  4 -> e2m1                         16 (E4M3 per block, fp32 per row)
=========  ================================  =====================================

The reductions over received rows (:meth:`FormatCodec.dequantize_sum`, and
:meth:`FormatCodec.dequantize_sum_requantize`: qgZ's intra-node hop) are fused: on CPU the native
kernels (``cpu_format_wire.dequantize_sum_wire`` / ``dequantize_sum_requantize_wire``), on CUDA the
Triton ones of the same names (``triton_format_reduce``), read the k received rows in place and
sum each tile of a row in fp32 while it is in L1 / registers, bit for bit the base class's generic
path (dequantize each source, add in fp32 in source order, round or re-encode), which stays the
specification and serves where neither is available. The
codec is not ``in_place`` (its received rows are unpacked with copies), but on CPU
:meth:`FormatCodec.encode` has the kernel write the codes straight into the wire rows
(``cpu_format_wire.encode_wire``).
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Optional

import torch

from zeropp.kernels import cpu_format_wire, cpu_formats
from zeropp.kernels import format_layout as fl
from zeropp.kernels.format_layout import FormatTensor
from zeropp.kernels.format_ops import dequantize_format, quantize_fp8, quantize_mx, quantize_nvfp4

from .codec_base import Codec
from .spec import QuantSpec

_KERNEL_SCHEME = {"fp8": "fp8", "mx": "mx", "mxint": "mx", "nvfp4": "nvfp4"}
"""Codec scheme -> the kernels' scheme (MXINT8 is MX with int8 elements)."""


class FormatCodec(Codec):
    """One of the float / microscaling schemes with its element and scale-rule choices fixed."""

    sums_into = True  # (dequantize_sum writes a given out=, fused or through the generic sum)

    def __init__(
        self, scheme: str, *, fp8_format: str = "e4m3", fp6_format: str = "e2m3", mx_scale: str = "ocp"
    ) -> None:
        if scheme not in _KERNEL_SCHEME:
            raise ValueError(f"FormatCodec scheme {scheme!r}; use one of {sorted(_KERNEL_SCHEME)}")
        self.scheme = scheme
        self.kernel_scheme = _KERNEL_SCHEME[scheme]
        self.fp8_format, self.fp6_format, self.mx_scale = str(fp8_format), str(fp6_format), str(mx_scale)
        self._elements = {
            "fp8": {8: self.fp8_format},
            "mx": {8: self.fp8_format, 6: self.fp6_format, 4: "e2m1"},
            "mxint": {8: "int8"},
            "nvfp4": {4: "e2m1"},
        }[scheme]

    def __repr__(self) -> str:
        return (
            f"FormatCodec({self.scheme!r}, fp8_format={self.fp8_format!r}, fp6_format={self.fp6_format!r}, "
            f"mx_scale={self.mx_scale!r})"
        )

    def for_spec(self, spec: QuantSpec) -> FormatCodec:
        return format_codec(self.scheme, str(spec.fp8_format), str(spec.fp6_format), str(spec.mx_scale))

    def element(self, bits: int) -> str:
        """The element format this codec sends at ``bits``."""
        e = self._elements.get(bits)
        if e is None:
            raise ValueError(f"scheme {self.scheme!r} has no {bits}-bit format; use bits in {sorted(self._elements)}")
        return e

    def quantize(self, x: torch.Tensor, bits: int, group_size: int, *, rows: int, seed: Optional[int]) -> FormatTensor:
        elem = self.element(bits)
        stochastic, kseed = seed is not None, 0 if seed is None else seed
        if self.kernel_scheme == "fp8":
            return quantize_fp8(x, elem, group_size, rows=rows, stochastic=stochastic, seed=kseed)
        fl.check_format_group_size(self.kernel_scheme, group_size)
        if self.kernel_scheme == "mx":
            return quantize_mx(x, elem, scale_rule=self.mx_scale, rows=rows, stochastic=stochastic, seed=kseed)
        return quantize_nvfp4(x, rows=rows, stochastic=stochastic, seed=kseed)

    def encode(self, x: torch.Tensor, bits: int, group_size: int, *, rows: int, seed: Optional[int]) -> torch.Tensor:
        """Wire rows ``uint8 [rows, wire_bytes]``; CPU tensors are quantized straight into them
        (``cpu_format_wire.encode_wire``: no codes tensor, no concatenation), others quantize and pack."""
        if x.device.type != "cpu":
            return super().encode(x, bits, group_size, rows=rows, seed=seed)
        elem = self.element(bits)
        if self.kernel_scheme != "fp8":
            fl.check_format_group_size(self.kernel_scheme, group_size)
        stochastic, kseed = seed is not None, 0 if seed is None else seed
        return cpu_format_wire.encode_wire(
            x, self.kernel_scheme, elem, group_size, self.mx_scale, rows, stochastic, kseed
        )

    def dequantize(
        self, q: FormatTensor, *, out: Optional[torch.Tensor] = None, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        return dequantize_format(q, out=out, dtype=dtype)

    def _fused(self, buf: torch.Tensor, dtype: torch.dtype = torch.float32) -> Optional[ModuleType]:
        """The module whose fused reductions take ``buf`` (``[k, rows, B]`` wire rows, an output
        dtype the kernels write): ``cpu_format_wire`` on CPU where its kernels are built,
        ``triton_format_reduce`` on CUDA where Triton is installed; None for the generic path."""
        if buf.dim() != 3 or dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return None
        if buf.device.type == "cpu":
            return cpu_format_wire if cpu_formats.native_enabled() else None
        if buf.is_cuda:
            from zeropp.kernels import triton_format_reduce  # imports triton: only where CUDA data is

            return triton_format_reduce if triton_format_reduce.HAS_TRITON else None
        return None

    def fuses(self, buf: torch.Tensor) -> bool:
        """Whether the reductions of ``buf`` run a fused kernel here (False: the generic path)."""
        return self._fused(buf) is not None

    def dequantize_sum(
        self,
        buf: torch.Tensor,
        cols: int,
        bits: int,
        group_size: int,
        *,
        dtype: torch.dtype = torch.float32,
        out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """As :meth:`Codec.dequantize_sum`, bit for bit; one fused pass over ``buf`` in place
        (``out``, ``[rows, cols]``, receives the sum; its dtype wins; a non-contiguous ``out`` on CPU
        is filled through the generic sum, the native kernels write contiguous rows)."""
        fused = self._fused(buf, dtype if out is None else out.dtype)
        if fused is cpu_format_wire and out is not None and not out.is_contiguous():
            fused = None
        if fused is None:
            s = super().dequantize_sum(buf, cols, bits, group_size, dtype=dtype if out is None else out.dtype)
            return s if out is None else out.copy_(s.view(out.shape))
        elem = self.element(bits)
        return fused.dequantize_sum_wire(buf, self.kernel_scheme, elem, cols, group_size, out=out, dtype=dtype)

    def dequantize_sum_requantize(
        self, buf: torch.Tensor, cols: int, bits: int, group_size: int, *, out_bits: int, seed: Optional[int]
    ) -> torch.Tensor:
        """As :meth:`Codec.dequantize_sum_requantize`, bit for bit; fused: each tile of the
        sum is quantized while it is in L1 (nvfp4 sums a row first: its tensor scale needs the row's
        absmax), the sum never written out."""
        fused = self._fused(buf)
        if fused is None:
            return super().dequantize_sum_requantize(buf, cols, bits, group_size, out_bits=out_bits, seed=seed)
        elem, out_elem = self.element(bits), self.element(out_bits)
        stochastic, kseed = seed is not None, 0 if seed is None else seed
        return fused.dequantize_sum_requantize_wire(
            buf, self.kernel_scheme, elem, out_elem, cols, group_size, self.mx_scale, stochastic, kseed
        )

    def wire_bytes(self, cols: int, bits: int, group_size: int) -> int:
        return fl.wire_bytes(self.kernel_scheme, self.element(bits), cols, group_size)

    def pack(self, q: FormatTensor) -> torch.Tensor:
        return fl.pack(q)

    def unpack(self, buf: torch.Tensor, cols: int, bits: int, group_size: int) -> FormatTensor:
        return fl.unpack(buf, self.kernel_scheme, self.element(bits), cols, group_size)


@functools.cache
def format_codec(scheme: str, fp8_format: str = "e4m3", fp6_format: str = "e2m3", mx_scale: str = "ocp") -> FormatCodec:
    """The codec of ``scheme`` with these format choices (one instance per setting)."""
    return FormatCodec(scheme, fp8_format=fp8_format, fp6_format=fp6_format, mx_scale=mx_scale)


FORMAT_SCHEMES = tuple(_KERNEL_SCHEME)
"""The schemes this module provides (declared in ``spec.py``, installed by ``codecs.py``)."""
