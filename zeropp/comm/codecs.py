"""Codecs: everything a quantized collective does to bytes, looked up by ``QuantSpec.scheme``.

The collectives and qgZ never call a quantization kernel directly. They ask the codec of the
spec's scheme to turn a ``[rows, cols]`` float tensor into wire rows and back, to sum stacked
received rows (the reduce side of qgZ) and to re-quantize such a sum (qgZ's intra-node hop).
So a new scheme (weight differences, ...) is a :class:`Codec` (``codec_base.py``) plus
``register_codec(name, codec, bits=...)``; every collective, the FSDP2/DDP plug-ins and the
engine can then use ``QuantSpec(scheme=name, ...)`` unchanged.

Wire format contract (what the collectives rely on): :meth:`Codec.pack` maps an encoded
``[..., rows, *]`` value to ``uint8 [..., rows, wire_bytes(cols, bits, group_size)]``, one
self-contained row per destination chunk, and :meth:`Codec.unpack` inverts it for any leading
dims (a received ``[k, rows, B]`` buffer unpacks to ``k`` stacked encodings).

``int`` (:class:`IntCodec`) is ZeRO++'s block-symmetric INT8/INT4 on ``zeropp.kernels``:
codes then fp32 scales in one row, so each hop sends one message instead of two. It is
zero-copy (:class:`WireLayout`): the kernels write codes and scales straight into views of the
send buffer, and read a received buffer through views, so no pack (``cat``) or unpack
(``contiguous``) copy is made. A codec that cannot do that keeps the generic pack/unpack path;
:attr:`Codec.in_place` tells the collectives which kind they hold.

The float and microscaling schemes ``fp8``, ``mx``, ``mxint`` and ``nvfp4`` are
``format_codecs.FormatCodec`` s, installed here; their element choices come from the spec
(:meth:`Codec.for_spec`).

``QuantSpec(rotation="hadamard")`` (SDP4Bit's rotation) is not a scheme of its own: :func:`codec_for`
wraps the scheme's codec in a :class:`HadamardCodec`, which rotates before encoding and rotates
back after decoding, with the same wire rows.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

from zeropp.kernels import (
    QuantizedTensor,
    dequantize,
    dequantize_sum,
    dequantize_sum_requantize,
    hadamard,
    num_groups,
    quantize,
    rotated_cols,
    row_bytes,
)

from .codec_base import Codec, Encoded
from .format_codecs import FORMAT_SCHEMES, format_codec
from .spec import QuantSpec, check_rotation_block, register_scheme, schemes, unregister_scheme


@dataclasses.dataclass(frozen=True)
class WireLayout:
    """Where codes and scales lie in the int codec's wire row of ``cols`` elements: codes
    (``code_bytes``) then fp32 scales (``4 * groups``), ``nbytes`` in all. Built once per
    (cols, bits, group size) by :func:`wire_layout`.

    When ``code_bytes`` is a multiple of 4 (any group size that is a multiple of 8), the scales
    of every row of a ``uint8 [..., rows, nbytes]`` buffer are 4-byte aligned, so
    :meth:`views` returns codes and scales as views of the buffer and the kernels read and write
    them in place (``in_place``). Otherwise the scales cannot be viewed as fp32 and the codec
    packs and unpacks with copies (the bytes on the wire are the same either way)."""

    cols: int
    bits: int
    group_size: int

    @property
    def code_bytes(self) -> int:
        return row_bytes(self.cols, self.bits, self.group_size)

    @property
    def groups(self) -> int:
        return num_groups(self.cols, self.group_size)

    @property
    def nbytes(self) -> int:
        """Bytes of one wire row."""
        return self.code_bytes + 4 * self.groups

    @property
    def in_place(self) -> bool:
        return self.code_bytes % 4 == 0

    def views(self, buf: torch.Tensor) -> QuantizedTensor:
        """``uint8 [..., rows, nbytes]`` (row-strided, e.g. contiguous) -> a QuantizedTensor whose
        codes ``[..., rows, code_bytes]`` and scales ``[..., rows, groups]`` are views into ``buf``
        (writing them writes the buffer). Needs ``in_place``."""
        if not self.in_place:
            raise ValueError(
                f"wire rows of {self.cols} elements at INT{self.bits}, group_size={self.group_size} "
                f"have {self.code_bytes} code bytes, not a multiple of 4: the scales cannot be viewed "
                "in place; use a group size that is a multiple of 8"
            )
        if buf.dtype != torch.uint8 or buf.shape[-1] != self.nbytes:
            raise ValueError(f"wire buffer must be uint8 [..., {self.nbytes}], got {buf.dtype} {tuple(buf.shape)}")
        rb = self.code_bytes
        codes = buf[..., :rb]
        codes = codes.view(torch.int8) if self.bits == 8 else codes  # [..., rows, rb]
        return QuantizedTensor.unchecked(
            codes, buf[..., rb:].view(torch.float32), self.cols, self.bits, self.group_size
        )

    def empty(self, rows: int, device: torch.device) -> tuple[torch.Tensor, QuantizedTensor]:
        """A new ``uint8 [rows, nbytes]`` wire buffer and its views (one allocation)."""
        buf = torch.empty(rows, self.nbytes, dtype=torch.uint8, device=device)
        return buf, self.views(buf)


@functools.lru_cache(maxsize=1024)
def wire_layout(cols: int, bits: int, group_size: int) -> WireLayout:
    """The int codec's wire layout for rows of ``cols`` elements (cached per shape)."""
    return WireLayout(cols, bits, group_size)


class IntCodec(Codec):
    """Block-wise symmetric INT8/INT4 (``zeropp.kernels``): one fp32 scale per ``group_size``
    elements; wire row = codes (``row_bytes``) then the scales' bytes (:class:`WireLayout`). The
    reductions use the fused kernels (one pass, fp32 accumulation, no intermediate tensor per
    source). Zero-copy: quantizations write straight into the wire buffer and reads go through
    views of it (``WireLayout.in_place``; other group sizes pack and unpack with copies)."""

    in_place = True

    def quantize(
        self, x: torch.Tensor, bits: int, group_size: int, *, rows: int, seed: Optional[int]
    ) -> QuantizedTensor:
        if seed is None:
            return quantize(x, bits, group_size, rows=rows)
        return quantize(x, bits, group_size, rows=rows, stochastic=True, seed=seed)

    def dequantize(
        self, q: QuantizedTensor, *, out: Optional[torch.Tensor] = None, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        return dequantize(q, out=out, dtype=dtype)

    def wire_bytes(self, cols: int, bits: int, group_size: int) -> int:
        return row_bytes(cols, bits, group_size) + 4 * num_groups(cols, group_size)

    def pack(self, q: QuantizedTensor) -> torch.Tensor:
        # [..., rows, row_bytes] codes ++ [..., rows, 4 * groups] scale bytes, same device
        return torch.cat([q.codes.view(torch.uint8), q.scales.contiguous().view(torch.uint8)], dim=-1)

    def encode(self, x: torch.Tensor, bits: int, group_size: int, *, rows: int, seed: Optional[int]) -> torch.Tensor:
        """Quantize straight into a new wire buffer ``uint8 [rows, B]`` (no pack copy). ``x`` may be
        a row-strided or swizzled view (``zeropp.kernels.layout.row_geometry``); it is read in place."""
        lay = wire_layout(x.numel() // rows, bits, group_size)
        if not lay.in_place:
            return super().encode(x, bits, group_size, rows=rows, seed=seed)
        buf, q = lay.empty(rows, x.device)  # [rows, B] and its codes / scales views
        if seed is None:
            quantize(x, bits, group_size, rows=rows, out=q)
        else:
            quantize(x, bits, group_size, rows=rows, stochastic=True, seed=seed, out=q)
        return buf

    def unpack(self, buf: torch.Tensor, cols: int, bits: int, group_size: int) -> QuantizedTensor:
        """Views into ``buf`` (no copy) when the layout allows (``WireLayout.in_place``); the result
        aliases ``buf``. Otherwise contiguous copies."""
        lay = wire_layout(cols, bits, group_size)
        if lay.in_place:
            return lay.views(buf)
        rb = lay.code_bytes
        codes = buf[..., :rb].contiguous()
        codes = codes.view(torch.int8) if bits == 8 else codes
        # own storage at offset 0 (.contiguous() keeps a one-row slice at its unaligned offset)
        scales = torch.empty(buf[..., rb:].shape, dtype=torch.uint8, device=buf.device).copy_(buf[..., rb:])
        scales = scales.view(torch.float32)
        return QuantizedTensor(codes, scales, cols, bits, group_size)

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
        """As :meth:`Codec.dequantize_sum`, reading ``buf`` in place; ``out`` (contiguous, its dtype
        wins) receives the sum directly."""
        return dequantize_sum(self.unpack(buf, cols, bits, group_size), out=out, dtype=dtype)

    def dequantize_sum_requantize(
        self, buf: torch.Tensor, cols: int, bits: int, group_size: int, *, out_bits: int, seed: Optional[int]
    ) -> torch.Tensor:
        q = self.unpack(buf, cols, bits, group_size)  # [k, rows, *] views of buf
        lay = wire_layout(cols, out_bits, group_size)
        dst = None
        if lay.in_place:
            send, dst = lay.empty(q.rows, buf.device)  # [rows, B'] written by the kernel in place
        if seed is None:
            q2 = dequantize_sum_requantize(q, out_bits, group_size, out=dst)
        else:
            q2 = dequantize_sum_requantize(q, out_bits, group_size, stochastic=True, seed=seed, out=dst)
        return send if dst is not None else self.pack(q2)  # [rows, B']


class HadamardCodec(Codec):
    """Any codec in a blockwise Walsh-Hadamard-rotated basis (``QuantSpec.rotation``).

    A row of ``cols`` elements is rotated (``zeropp.kernels.hadamard``: zero padded to whole
    blocks, ``rotated_cols`` elements, fp32) and those values are quantized; a received row is
    dequantized in the rotated basis and rotated back (the transform is its own inverse), keeping
    the first ``cols`` elements. The block divides the group size, so the padded rotated row has
    the same quantization groups as the plain one: the wire rows, and every byte count, are the
    inner codec's for ``cols``. An encoding is the inner codec's value labelled with the *plain*
    ``cols`` (its codes and scales are those of the rotated row, same shapes), so qgZ's
    error-feedback path can slice and rebuild it like any encoding of the inner codec.

    Reductions stay in the rotated basis: the rotation is linear, so the sum of rotated
    dequantized rows is the rotated sum. :meth:`dequantize_sum_requantize` (qgZ between its hops)
    is therefore the inner codec's (for int: the fused kernel) unchanged (sum, then re-quantize, both rotated), and
    :meth:`dequantize_sum` sums rotated rows in fp32 and rotates back once. Rotating back before
    the sum and again before re-quantizing would give the same values up to fp32 rounding, at
    the cost of two extra passes over the data and two more roundings.
    """

    def __init__(self, inner: Codec, block: Optional[int]) -> None:
        self.inner = inner
        self.block = block
        """The rotation block, or None for the call's group size."""
        self.in_place = inner.in_place
        self._blocks: dict[int, int] = {}  # group size -> checked block

    def block_for(self, group_size: int) -> int:
        """The rotation block used with ``group_size`` (checked once per group size)."""
        b = self._blocks.get(group_size)
        if b is None:
            b = self._blocks[group_size] = check_rotation_block(self.block, group_size)
        return b

    def _rotated(self, q: Encoded) -> tuple[Encoded, int]:
        """``q`` relabelled with its rotated row length (same codes and scales), and the block."""
        b = self.block_for(q.group_size)
        return self._plain(q, rotated_cols(q.cols, b)), b

    @staticmethod
    def _plain(q: Encoded, cols: int) -> Encoded:
        """``q`` labelled with row length ``cols`` (same padded blocks, so the same codes and scales)."""
        if isinstance(q, QuantizedTensor):
            return QuantizedTensor.unchecked(q.codes, q.scales, cols, q.bits, q.group_size)
        return dataclasses.replace(q, cols=cols)

    def rotate(self, x: torch.Tensor, group_size: int, rows: int) -> torch.Tensor:
        """``x`` (``rows`` rows, any row-strided or swizzled view) -> rotated fp32 ``[rows, rotated_cols]``."""
        return hadamard(x, self.block_for(group_size), rows=rows)

    def quantize(self, x: torch.Tensor, bits: int, group_size: int, *, rows: int, seed: Optional[int]) -> Encoded:
        cols = x.numel() // rows
        return self._plain(
            self.inner.quantize(self.rotate(x, group_size, rows), bits, group_size, rows=rows, seed=seed), cols
        )

    def encode(self, x: torch.Tensor, bits: int, group_size: int, *, rows: int, seed: Optional[int]) -> torch.Tensor:
        """Rotate (reading ``x`` in place), then quantize straight into a new wire buffer."""
        return self.inner.encode(self.rotate(x, group_size, rows), bits, group_size, rows=rows, seed=seed)

    def dequantize(
        self, q: Encoded, *, out: Optional[torch.Tensor] = None, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """Dequantize in the rotated basis (fp32), rotate back into ``out`` / a new ``[rows, cols]``."""
        rq, b = self._rotated(q)
        v = self.inner.dequantize(rq)  # [rows, rotated_cols] fp32
        return hadamard(v, b, rows=v.shape[0], out_cols=q.cols, out=out, dtype=dtype)

    def wire_bytes(self, cols: int, bits: int, group_size: int) -> int:
        return self.inner.wire_bytes(rotated_cols(cols, self.block_for(group_size)), bits, group_size)

    def pack(self, q: Encoded) -> torch.Tensor:
        return self.inner.pack(q)

    def unpack(self, buf: torch.Tensor, cols: int, bits: int, group_size: int) -> Encoded:
        ch = rotated_cols(cols, self.block_for(group_size))
        return self._plain(self.inner.unpack(buf, ch, bits, group_size), cols)

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
        """Sum the rotated rows in fp32 (the inner codec's sum), then rotate back once."""
        b = self.block_for(group_size)
        s = self.inner.dequantize_sum(buf, rotated_cols(cols, b), bits, group_size)  # [rows, rotated_cols] fp32
        return hadamard(s, b, rows=s.shape[0], out_cols=cols, out=out, dtype=dtype)

    def dequantize_sum_requantize(
        self, buf: torch.Tensor, cols: int, bits: int, group_size: int, *, out_bits: int, seed: Optional[int]
    ) -> torch.Tensor:
        """qgZ between its hops, all in the rotated basis: the inner codec's reduction."""
        ch = rotated_cols(cols, self.block_for(group_size))
        return self.inner.dequantize_sum_requantize(buf, ch, bits, group_size, out_bits=out_bits, seed=seed)


_CODECS: dict[str, Codec] = {"int": IntCodec(), **{name: format_codec(name) for name in FORMAT_SCHEMES}}
_ROTATED: dict[tuple[Codec, Optional[int]], HadamardCodec] = {}
"""``(inner codec, hadamard_block)`` -> its Hadamard codec (built once per pair)."""


def register_codec(
    name: str,
    codec: Codec,
    *,
    bits: tuple[int, ...],
    group_size: Optional[int] = None,
    fields: Optional[dict[str, tuple[int, ...]]] = None,
) -> None:
    """Make scheme ``name`` usable by every collective: declares it (``spec.register_scheme``,
    so ``QuantSpec(scheme=name)`` validates; ``group_size`` a block size the format fixes,
    ``fields`` the spec's format fields it reads) and installs ``codec``. Re-registering replaces;
    the built-in schemes (``spec.BUILTIN_SCHEMES``) cannot be replaced."""
    if not isinstance(codec, Codec):
        raise TypeError(
            f"register_codec({name!r}, ...): codec must subclass zeropp.comm.codecs.Codec, got {type(codec).__name__}"
        )
    register_scheme(name, tuple(bits), group_size=group_size, fields=fields)
    _CODECS[name] = codec


def unregister_codec(name: str) -> None:
    """Remove a registered scheme and its codec (the built-in schemes stay)."""
    unregister_scheme(name)
    _CODECS.pop(name, None)


def codecs() -> dict[str, Codec]:
    """Registered scheme names and their codecs."""
    return dict(_CODECS)


def codec_for(spec: QuantSpec) -> Codec:
    """The codec of ``spec.scheme`` for the spec's format fields (:meth:`Codec.for_spec`), wrapped
    in a :class:`HadamardCodec` for ``rotation="hadamard"``; a clear error for a scheme declared
    without one."""
    codec = _CODECS.get(spec.scheme)
    if spec.scheme not in schemes():  # unregistered after the spec was built
        raise ValueError(f"QuantSpec.scheme={spec.scheme!r} is not registered any more; use one of {sorted(schemes())}")
    if codec is None:
        raise ValueError(
            f"QuantSpec.scheme={spec.scheme!r} is declared but has no codec; register it with "
            f"zeropp.comm.codecs.register_codec({spec.scheme!r}, codec, bits=...)"
        )
    codec = codec.for_spec(spec)
    if spec.rotation == "hadamard":
        key = (codec, spec.hadamard_block)
        rotated = _ROTATED.get(key)
        if rotated is None:
            rotated = _ROTATED[key] = HadamardCodec(codec, spec.hadamard_block)
        return rotated
    return codec
