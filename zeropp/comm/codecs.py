"""Codecs: everything a quantized collective does to bytes, looked up by ``QuantSpec.scheme``.

The collectives and qgZ never call a quantization kernel directly. They ask the codec of the
spec's scheme to turn a ``[rows, cols]`` float tensor into wire rows and back, to sum stacked
received rows (the reduce side of qgZ) and to re-quantize such a sum (qgZ's intra-node hop).
So a new scheme (Hadamard rotation, weight differences, fp8, ...) is a :class:`Codec` plus
``register_codec(name, codec, bits=...)``; every collective, the FSDP2/DDP plug-ins and the
engine can then use ``QuantSpec(scheme=name, ...)`` unchanged.

Wire format contract (what the collectives rely on): :meth:`Codec.pack` maps an encoded
``[..., rows, *]`` value to ``uint8 [..., rows, wire_bytes(cols, bits, group_size)]``, one
self-contained row per destination chunk, and :meth:`Codec.unpack` inverts it for any leading
dims (a received ``[k, rows, B]`` buffer unpacks to ``k`` stacked encodings).

``int`` (:class:`IntCodec`) is ZeRO++'s block-symmetric INT8/INT4 on ``zeropp.kernels``:
codes then fp32 scales in one row, so each hop sends one message instead of two.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from zeropp.kernels import (
    QuantizedTensor,
    dequantize,
    dequantize_sum,
    dequantize_sum_requantize,
    num_groups,
    quantize,
    row_bytes,
)

from .spec import QuantSpec, register_scheme, schemes, unregister_scheme

Encoded = Any
"""A codec's in-memory quantized value (``QuantizedTensor`` for ``int``); opaque to collectives."""


class Codec:
    """Base class of a quantization scheme's wire operations.

    A subclass implements :meth:`quantize`, :meth:`dequantize`, :meth:`wire_bytes`, :meth:`pack`
    and :meth:`unpack`. The reductions over received wire rows (:meth:`dequantize_sum`,
    :meth:`dequantize_sum_requantize`) have generic, unfused defaults built from those; a scheme
    with fused kernels overrides them. ``seed`` None means round to nearest; an int is the
    kernel seed of stochastic rounding (the collectives derive it, see ``stochastic.py``).
    """

    def quantize(self, x: torch.Tensor, bits: int, group_size: int, *, rows: int, seed: Optional[int]) -> Encoded:
        """``x`` (numel divisible by ``rows``) -> ``rows`` encoded rows of ``numel / rows`` elements."""
        raise NotImplementedError

    def dequantize(self, q: Encoded, *, out: Optional[torch.Tensor] = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Encoded ``[rows, *]`` -> ``[rows, cols]`` in ``dtype`` (or written into ``out``, whose dtype wins)."""
        raise NotImplementedError

    def wire_bytes(self, cols: int, bits: int, group_size: int) -> int:
        """Bytes of one packed row of ``cols`` elements."""
        raise NotImplementedError

    def pack(self, q: Encoded) -> torch.Tensor:
        """Encoded ``[..., rows, *]`` -> ``uint8 [..., rows, wire_bytes]`` on the encoding's device."""
        raise NotImplementedError

    def unpack(self, buf: torch.Tensor, cols: int, bits: int, group_size: int) -> Encoded:
        """Inverse of :meth:`pack` for ``uint8 [..., rows, wire_bytes]``."""
        raise NotImplementedError

    def encode(self, x: torch.Tensor, bits: int, group_size: int, *, rows: int, seed: Optional[int]) -> torch.Tensor:
        """Quantize straight into wire rows: ``uint8 [rows, wire_bytes]``."""
        return self.pack(self.quantize(x, bits, group_size, rows=rows, seed=seed))

    def dequantize_sum(self, buf: torch.Tensor, cols: int, bits: int, group_size: int, *,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Received wire rows ``uint8 [k, rows, B]`` -> their sum over k, accumulated in fp32,
        as ``[rows, cols]`` in ``dtype``. Generic: dequantize each of the k and add."""
        k, rows = buf.shape[0], buf.shape[1]
        acc = torch.zeros(rows, cols, dtype=torch.float32, device=buf.device)  # [rows, cols]
        for i in range(k):
            acc += self.dequantize(self.unpack(buf[i], cols, bits, group_size)).view(rows, cols)
        return acc.to(dtype)

    def dequantize_sum_requantize(self, buf: torch.Tensor, cols: int, bits: int, group_size: int, *,
                                  out_bits: int, seed: Optional[int]) -> torch.Tensor:
        """Received wire rows ``uint8 [k, rows, B]`` at ``bits`` -> their sum as wire rows at
        ``out_bits`` (``uint8 [rows, B']``, same group size): qgZ's intra-node hop. Generic:
        :meth:`dequantize_sum` then :meth:`encode`."""
        s = self.dequantize_sum(buf, cols, bits, group_size)  # [rows, cols] fp32
        return self.encode(s, out_bits, group_size, rows=s.shape[0], seed=seed)


class IntCodec(Codec):
    """Block-wise symmetric INT8/INT4 (``zeropp.kernels``): one fp32 scale per ``group_size``
    elements; wire row = codes (``row_bytes``) then the scales' bytes. The reductions use the
    fused kernels (one pass, fp32 accumulation, no intermediate tensor per source)."""

    def quantize(self, x: torch.Tensor, bits: int, group_size: int, *, rows: int, seed: Optional[int]) -> QuantizedTensor:
        if seed is None:
            return quantize(x, bits, group_size, rows=rows)
        return quantize(x, bits, group_size, rows=rows, stochastic=True, seed=seed)

    def dequantize(self, q: QuantizedTensor, *, out: Optional[torch.Tensor] = None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(q, out=out, dtype=dtype)

    def wire_bytes(self, cols: int, bits: int, group_size: int) -> int:
        return row_bytes(cols, bits, group_size) + 4 * num_groups(cols, group_size)

    def pack(self, q: QuantizedTensor) -> torch.Tensor:
        # [..., rows, row_bytes] codes ++ [..., rows, 4 * groups] scale bytes, same device
        return torch.cat([q.codes.view(torch.uint8), q.scales.contiguous().view(torch.uint8)], dim=-1)

    def unpack(self, buf: torch.Tensor, cols: int, bits: int, group_size: int) -> QuantizedTensor:
        rb = row_bytes(cols, bits, group_size)
        codes = buf[..., :rb].contiguous()  # own storage: the dtype views below need aligned offsets
        codes = codes.view(torch.int8) if bits == 8 else codes
        scales = buf[..., rb:].contiguous().view(torch.float32)
        return QuantizedTensor(codes, scales, cols, bits, group_size)

    def dequantize_sum(self, buf: torch.Tensor, cols: int, bits: int, group_size: int, *,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_sum(self.unpack(buf, cols, bits, group_size), dtype=dtype)

    def dequantize_sum_requantize(self, buf: torch.Tensor, cols: int, bits: int, group_size: int, *,
                                  out_bits: int, seed: Optional[int]) -> torch.Tensor:
        q = self.unpack(buf, cols, bits, group_size)  # [k, rows, *]
        if seed is None:
            q2 = dequantize_sum_requantize(q, out_bits, group_size)
        else:
            q2 = dequantize_sum_requantize(q, out_bits, group_size, stochastic=True, seed=seed)
        return self.pack(q2)  # [rows, B']


_CODECS: dict[str, Codec] = {"int": IntCodec()}


def register_codec(name: str, codec: Codec, *, bits: tuple[int, ...]) -> None:
    """Make scheme ``name`` usable by every collective: declares it (``spec.register_scheme``,
    so ``QuantSpec(scheme=name)`` validates) and installs ``codec``. Re-registering replaces."""
    if not isinstance(codec, Codec):
        raise TypeError(f"register_codec({name!r}, ...): codec must subclass zeropp.comm.codecs.Codec, "
                        f"got {type(codec).__name__}")
    if name == "int":
        raise ValueError("the built-in scheme 'int' cannot be replaced; register the codec under a new name")
    register_scheme(name, tuple(bits))
    _CODECS[name] = codec


def unregister_codec(name: str) -> None:
    """Remove a registered scheme and its codec (``int`` stays)."""
    unregister_scheme(name)
    _CODECS.pop(name, None)


def codecs() -> dict[str, Codec]:
    """Registered scheme names and their codecs."""
    return dict(_CODECS)


def codec_for(spec: QuantSpec) -> Codec:
    """The codec of ``spec.scheme``; a clear error for a scheme declared without one."""
    codec = _CODECS.get(spec.scheme)
    if spec.scheme not in schemes():  # unregistered after the spec was built
        raise ValueError(f"QuantSpec.scheme={spec.scheme!r} is not registered any more; use one of {sorted(schemes())}")
    if codec is None:
        raise ValueError(
            f"QuantSpec.scheme={spec.scheme!r} is declared but has no codec; register it with "
            f"zeropp.comm.codecs.register_codec({spec.scheme!r}, codec, bits=...)"
        )
    return codec
