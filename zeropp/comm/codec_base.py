"""The base class of every codec (:class:`Codec`) and the type of its encodings, apart from the
codecs themselves so that codec modules (``codecs.py``, ``format_codecs.py``) build on it without
importing each other in a circle. ``zeropp.comm.codecs`` re-exports both; import them from there."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from .spec import QuantSpec

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

    in_place: bool = False
    """True when the codec works on wire buffers in place: :meth:`encode` and
    :meth:`quantize` accept row-strided and two-level views of the input (a swizzled
    ``[a, b, cols]`` view, columns of a larger buffer), :meth:`dequantize` writes a row-strided
    ``out``, and :meth:`dequantize_sum` takes ``out=``. False (the default) makes the collectives
    hand it contiguous tensors, as a minimal codec expects."""

    sums_into: bool = False
    """True when :meth:`dequantize_sum` takes ``out=`` (contiguous ``[rows, cols]``, its dtype
    wins) and writes the sum straight into it, even if the codec is not :attr:`in_place`: the
    collectives then skip a temporary and a copy."""

    def quantize(self, x: torch.Tensor, bits: int, group_size: int, *, rows: int, seed: Optional[int]) -> Encoded:
        """``x`` (numel divisible by ``rows``) -> ``rows`` encoded rows of ``numel / rows`` elements."""
        raise NotImplementedError

    def dequantize(
        self, q: Encoded, *, out: Optional[torch.Tensor] = None, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
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

    def for_spec(self, spec: QuantSpec) -> Codec:
        """The codec that runs ``spec`` (:func:`codec_for` asks): ``self``, or for a scheme whose
        spec fields choose a format (``fp8_format``, ...) the variant for those choices."""
        return self

    def encode(self, x: torch.Tensor, bits: int, group_size: int, *, rows: int, seed: Optional[int]) -> torch.Tensor:
        """Quantize straight into wire rows: ``uint8 [rows, wire_bytes]``."""
        return self.pack(self.quantize(x, bits, group_size, rows=rows, seed=seed))

    def dequantize_sum(
        self, buf: torch.Tensor, cols: int, bits: int, group_size: int, *, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """Received wire rows ``uint8 [k, rows, B]`` -> their sum over k, accumulated in fp32,
        as ``[rows, cols]`` in ``dtype``. Generic: dequantize each of the k and add."""
        k, rows = buf.shape[0], buf.shape[1]
        acc = torch.zeros(rows, cols, dtype=torch.float32, device=buf.device)  # [rows, cols]
        for i in range(k):
            acc += self.dequantize(self.unpack(buf[i], cols, bits, group_size)).view(rows, cols)
        return acc.to(dtype)

    def dequantize_sum_requantize(
        self, buf: torch.Tensor, cols: int, bits: int, group_size: int, *, out_bits: int, seed: Optional[int]
    ) -> torch.Tensor:
        """Received wire rows ``uint8 [k, rows, B]`` at ``bits`` -> their sum as wire rows at
        ``out_bits`` (``uint8 [rows, B']``, same group size): qgZ's intra-node hop. Generic:
        :meth:`dequantize_sum` then :meth:`encode`."""
        s = self.dequantize_sum(buf, cols, bits, group_size)  # [rows, cols] fp32
        return self.encode(s, out_bits, group_size, rows=s.shape[0], seed=seed)


def generic_sum_requantize(
    codec: Codec, buf: torch.Tensor, cols: int, bits: int, group_size: int, *, out_bits: int, seed: Optional[int]
) -> torch.Tensor:
    """The specification of ``codec.dequantize_sum_requantize`` that a fused override must match:
    :meth:`Codec.dequantize_sum`'s generic sum, then ``codec.encode``. (The base method itself
    calls the codec's own, possibly fused, ``dequantize_sum``.) For tests and benchmarks."""
    s = Codec.dequantize_sum(codec, buf, cols, bits, group_size)  # [rows, cols] fp32
    return codec.encode(s, out_bits, group_size, rows=s.shape[0], seed=seed)
