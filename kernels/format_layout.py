"""The floating-point and microscaling wire formats: element formats, the quantized value type
(:class:`FormatTensor`), the per-row wire layout and its pack / unpack.

Three schemes, each a row-wise layout like the int one (``layout.py``): a tensor is quantized as
``rows`` independent rows of ``cols`` elements, each row cut into blocks of ``group_size`` (the
last one zero padded), so a row is one self-contained message:

=========  =====================================  ==========  ==============================
scheme     elements                               block       scales per row
=========  =====================================  ==========  ==============================
``fp8``    e4m3 or e5m2 (8 bits)                  any         one fp32 per block
``mx``     e4m3, e5m2 (8), e3m2, e2m3 (6),        32          one E8M0 byte per block
           e2m1 (4), int8 (8, MX INT8)
``nvfp4``  e2m1 (4 bits)                          16          one E4M3 byte per block, then
                                                              one fp32 tensor scale per row
=========  =====================================  ==========  ==============================

Wire row (``wire_bytes``): the packed element codes (``code_bytes``: 8-bit codes one per byte,
6-bit codes four in three bytes, 4-bit codes two per byte), then the block scales
(``4 * groups`` bytes for fp8, ``groups`` bytes for mx / nvfp4), then for nvfp4 the 4 bytes of
the row's fp32 tensor scale. Packing of sub-byte codes is little-endian: 4-bit codes
``c0 | c1 << 4`` (element ``2i`` in the low nibble, as the int layout), 6-bit codes
``w = c0 | c1 << 6 | c2 << 12 | c3 << 18`` stored as the bytes ``w & 255, w >> 8 & 255,
w >> 16``. The arithmetic that produces the codes and scales is ``format_reference.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

from .layout import MAX_GROUP_SIZE, check_float_dtype, check_seed, num_groups, split_rows


@dataclasses.dataclass(frozen=True, kw_only=True)
class ElementFormat:
    """One element format of the OCP MX v1.0 specification (or MX INT8)."""

    name: str
    """``e4m3``, ``e5m2``, ``e3m2``, ``e2m3``, ``e2m1`` or ``int8``."""
    bits: int
    """Code width on the wire: 8, 6 or 4."""
    ebits: int
    """Exponent field width (0 for int8)."""
    mbits: int
    """Mantissa field width (for int8: the 6 fractional bits of ``k / 64``)."""
    bias: int
    """Exponent bias (0 for int8)."""
    max: float
    """Largest finite magnitude: 448, 57344, 28, 7.5, 6, 127/64."""
    emax: int
    """Exponent of the largest normal (8, 15, 4, 2, 2, 0): the MX shared scale's offset."""
    nan_code: Optional[int]
    """The code written for a NaN element (E4M3 / E5M2: ``0x7F``), None for formats without NaN."""

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal, ``1 - bias``."""
        return 1 - self.bias

    @property
    def is_int(self) -> bool:
        return self.ebits == 0


ELEMENTS: dict[str, ElementFormat] = {
    "e4m3": ElementFormat(name="e4m3", bits=8, ebits=4, mbits=3, bias=7, max=448.0, emax=8, nan_code=0x7F),
    "e5m2": ElementFormat(name="e5m2", bits=8, ebits=5, mbits=2, bias=15, max=57344.0, emax=15, nan_code=0x7F),
    "e3m2": ElementFormat(name="e3m2", bits=6, ebits=3, mbits=2, bias=3, max=28.0, emax=4, nan_code=None),
    "e2m3": ElementFormat(name="e2m3", bits=6, ebits=2, mbits=3, bias=1, max=7.5, emax=2, nan_code=None),
    "e2m1": ElementFormat(name="e2m1", bits=4, ebits=2, mbits=1, bias=1, max=6.0, emax=2, nan_code=None),
    "int8": ElementFormat(name="int8", bits=8, ebits=0, mbits=6, bias=0, max=127 / 64, emax=0, nan_code=None),
}
"""The element formats by name."""

SCHEME_ELEMENTS: dict[str, tuple[str, ...]] = {
    "fp8": ("e4m3", "e5m2"),
    "mx": ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1", "int8"),
    "nvfp4": ("e2m1",),
}
"""Element formats each scheme takes."""

FIXED_GROUP_SIZE: dict[str, int] = {"mx": 32, "nvfp4": 16}
"""Schemes whose block size is fixed by the format (fp8 takes any group size)."""

SCALE_RULES = ("ocp", "round_up")
"""MX shared-scale rules: ``ocp`` = ``2**(floor(log2 absmax) - emax)`` (OCP MX v1.0; the largest
elements may saturate), ``round_up`` = the smallest power of two with ``absmax / X <= max`` (no
element saturates; the MXFP8 training recipes' rule)."""

E8M0_NAN = 255
"""E8M0 code of a block holding NaN or Inf: the whole block decodes to NaN."""

NVFP4_TENSOR_DIVISOR = 6.0 * 448.0
"""nvfp4's per-row scale is ``absmax(row) / (6 * 448)``: E2M1's max times E4M3's max."""


def element(name: str, scheme: Optional[str] = None) -> ElementFormat:
    """The element format ``name`` (checked against ``scheme``'s choices when given)."""
    allowed = SCHEME_ELEMENTS[scheme] if scheme is not None else tuple(ELEMENTS)
    if name not in allowed:
        where = f"scheme {scheme!r}" if scheme is not None else "the formats"
        raise ValueError(f"element format {name!r} is not one of {where}'s: use one of {', '.join(allowed)}")
    return ELEMENTS[name]


def check_scheme(scheme: str) -> None:
    if scheme not in SCHEME_ELEMENTS:
        raise ValueError(f"format scheme {scheme!r} is unknown; use one of {', '.join(SCHEME_ELEMENTS)}")


def check_format_group_size(scheme: str, group_size: int) -> None:
    """mx blocks are 32 elements and nvfp4 blocks 16 (fixed by the formats); fp8 takes any
    positive group size up to ``MAX_GROUP_SIZE``."""
    check_scheme(scheme)
    fixed = FIXED_GROUP_SIZE.get(scheme)
    if fixed is not None and group_size != fixed:
        raise ValueError(
            f"scheme {scheme!r} has blocks of {fixed} elements fixed by the format; group_size={group_size!r} "
            f"cannot be used: use group_size={fixed} (or None)"
        )
    if isinstance(group_size, bool) or not isinstance(group_size, int) or not 0 < group_size <= MAX_GROUP_SIZE:
        raise ValueError(f"group_size must be an int in [1, {MAX_GROUP_SIZE}], got {group_size!r}")


def check_scale_rule(rule: str) -> None:
    if rule not in SCALE_RULES:
        raise ValueError(f"MX scale rule {rule!r} is unknown; use one of {', '.join(SCALE_RULES)}")


def padded_cols(cols: int, group_size: int) -> int:
    """Elements per row once padded to whole blocks."""
    return num_groups(cols, group_size) * group_size


def code_bytes(cols: int, elem: str, group_size: int) -> int:
    """Bytes of packed element codes per row. The padded row length of a 6-bit format is a
    multiple of 4 (mx blocks are 32), so the 3-byte groups never straddle rows."""
    n = padded_cols(cols, group_size) * ELEMENTS[elem].bits
    if n % 8:
        raise ValueError(
            f"{elem} codes of a row padded to {padded_cols(cols, group_size)} elements do not fill whole bytes; "
            f"use an even group size"
        )
    return n // 8


def scale_bytes(scheme: str, cols: int, group_size: int) -> int:
    """Bytes of scales per row: 4 per block (fp8), 1 per block (mx), 1 per block + 4 (nvfp4)."""
    g = num_groups(cols, group_size)
    return {"fp8": 4 * g, "mx": g, "nvfp4": g + 4}[scheme]


@functools.lru_cache(maxsize=4096)
def wire_bytes(scheme: str, elem: str, cols: int, group_size: int) -> int:
    """Bytes of one wire row of ``cols`` elements (codes, then scales, then nvfp4's tensor scale)."""
    check_format_group_size(scheme, group_size)
    element(elem, scheme)
    return code_bytes(cols, elem, group_size) + scale_bytes(scheme, cols, group_size)


def bits_per_element(scheme: str, elem: str, group_size: int, cols: Optional[int] = None) -> float:
    """Wire bits per element, scales included (for a row of ``cols``; default one block)."""
    cols = group_size if cols is None else cols
    return 8 * wire_bytes(scheme, elem, cols, group_size) / max(cols, 1)


@dataclasses.dataclass(frozen=True)
class FormatTensor:
    """Codes and scales of a tensor in one of the formats (the module docstring has the layout).

    ``codes``, ``scales`` and ``tensor_scales`` may carry extra leading dimensions (``[k, rows, *]``)
    when k values of one layout are stacked (a received buffer unpacked)."""

    codes: torch.Tensor
    """``uint8 [..., rows, code_bytes]``: packed element codes."""
    scales: torch.Tensor
    """``[..., rows, groups]``: fp32 (fp8: 0 for a zero block, NaN for a non-finite one), or uint8
    codes (mx: E8M0, 255 = NaN block; nvfp4: E4M3, 0x7F = NaN block)."""
    tensor_scales: Optional[torch.Tensor]
    """nvfp4: ``fp32 [..., rows, 1]``, each row's tensor scale; None for fp8 and mx."""
    cols: int
    """Elements per row before padding."""
    scheme: str
    """``fp8``, ``mx`` or ``nvfp4``."""
    elem: str
    """The element format's name (``ELEMENTS``)."""
    group_size: int
    """Elements per block."""

    def __post_init__(self) -> None:
        check_format_group_size(self.scheme, self.group_size)
        element(self.elem, self.scheme)
        cb, g = code_bytes(self.cols, self.elem, self.group_size), num_groups(self.cols, self.group_size)
        sdt = torch.float32 if self.scheme == "fp8" else torch.uint8
        if self.codes.dtype != torch.uint8 or self.codes.shape[-1] != cb:
            raise ValueError(
                f"{self.scheme}/{self.elem} codes must be uint8 [..., {cb}], got "
                f"{self.codes.dtype} {tuple(self.codes.shape)}"
            )
        if self.scales.dtype != sdt or tuple(self.scales.shape) != (*self.codes.shape[:-1], g):
            raise ValueError(
                f"{self.scheme} scales must be {sdt} {(*self.codes.shape[:-1], g)}, got "
                f"{self.scales.dtype} {tuple(self.scales.shape)}"
            )
        want_t = (*self.codes.shape[:-1], 1) if self.scheme == "nvfp4" else None
        got_t = None if self.tensor_scales is None else tuple(self.tensor_scales.shape)
        if got_t != want_t or (self.tensor_scales is not None and self.tensor_scales.dtype != torch.float32):
            raise ValueError(
                f"{self.scheme} tensor_scales must be {'fp32 ' + str(want_t) if want_t else 'None'}, got {got_t}"
            )

    @property
    def rows(self) -> int:
        return self.codes.shape[-2]

    @property
    def nbytes(self) -> int:
        """Bytes on the wire (codes, scales, tensor scales)."""
        t = 0 if self.tensor_scales is None else self.tensor_scales.numel() * 4
        return self.codes.numel() + self.scales.numel() * self.scales.element_size() + t


def check_format_args(
    x: torch.Tensor, scheme: str, elem: str, group_size: int, rows: int, seed: int
) -> tuple[int, int]:
    """Checks shared by every implementation of ``quantize_<scheme>``; returns ``(cols, seed)``."""
    check_format_group_size(scheme, group_size)
    element(elem, scheme)
    check_float_dtype(x.dtype, "input")
    seed = check_seed(seed)
    cols = split_rows(x.numel(), rows)
    code_bytes(cols, elem, group_size)
    return cols, seed


def check_format_tensor(q: FormatTensor, scheme: str) -> int:
    """``dequantize_<scheme>`` takes an unstacked ``[rows, *]`` value of its scheme; returns rows."""
    if not isinstance(q, FormatTensor) or q.scheme != scheme:
        got = q.scheme if isinstance(q, FormatTensor) else type(q).__name__
        raise ValueError(f"dequantize_{scheme} takes a {scheme} FormatTensor, got {got}")
    if q.codes.dim() != 2:
        raise ValueError(f"dequantize_{scheme} takes codes shaped [rows, *], got {tuple(q.codes.shape)}")
    return q.codes.shape[0]


def received_rows(
    buf: torch.Tensor, scheme: str, elem: str, cols: int, group_size: int
) -> tuple[torch.Tensor, int, int]:
    """Checks shared by every implementation of the reductions over received wire rows ``uint8 [k,
    rows, wire_bytes]``: returns them (a copy only where a row is not contiguous in memory), their
    code bytes per row and blocks per row."""
    nb = wire_bytes(scheme, elem, cols, group_size)
    if buf.dtype != torch.uint8 or buf.dim() != 3 or buf.shape[-1] != nb:
        raise ValueError(
            f"{scheme}/{elem} received rows of {cols} elements are uint8 [k, rows, {nb}], got "
            f"{buf.dtype} {tuple(buf.shape)}"
        )
    if nb > 1 and buf.stride(2) != 1:
        buf = buf.contiguous()
    return buf, code_bytes(cols, elem, group_size), num_groups(cols, group_size)


def check_requantize_args(scheme: str, out_elem: str, scale_rule: str, seed: int) -> int:
    """The re-quantizing reduction's output checks, shared by its implementations (the output
    format, the MX scale rule, the seed); returns the seed as a plain int."""
    element(out_elem, scheme)
    if scheme == "mx":
        check_scale_rule(scale_rule)
    return check_seed(seed)


# ----------------------------------------------------------------------------------------------
# Wire rows: pack / unpack (layout only, the same for every implementation).
# ----------------------------------------------------------------------------------------------
def pack(q: FormatTensor) -> torch.Tensor:
    """FormatTensor ``[..., rows, *]`` -> ``uint8 [..., rows, wire_bytes]`` (codes, scales, tensor scale)."""
    parts = [q.codes, q.scales.contiguous().view(torch.uint8)]
    if q.tensor_scales is not None:
        parts.append(q.tensor_scales.contiguous().view(torch.uint8))
    return torch.cat(parts, dim=-1)


def _f32(buf: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., 4n]`` (any offset) -> fp32 ``[..., n]`` in its own storage."""
    own = torch.empty(buf.shape, dtype=torch.uint8, device=buf.device)
    own.copy_(buf)
    return own.view(torch.float32)


def unpack(buf: torch.Tensor, scheme: str, elem: str, cols: int, group_size: int) -> FormatTensor:
    """Inverse of :func:`pack` for ``uint8 [..., rows, wire_bytes]`` (copies; the result owns its storage)."""
    nb = wire_bytes(scheme, elem, cols, group_size)
    if buf.dtype != torch.uint8 or buf.dim() < 2 or buf.shape[-1] != nb:
        raise ValueError(
            f"{scheme}/{elem} wire rows of {cols} elements are uint8 [..., rows, {nb}], got "
            f"{buf.dtype} {tuple(buf.shape)}"
        )
    cb, g = code_bytes(cols, elem, group_size), num_groups(cols, group_size)
    codes = buf[..., :cb].contiguous()
    if scheme == "fp8":
        return FormatTensor(codes, _f32(buf[..., cb:]), None, cols, scheme, elem, group_size)
    scales = buf[..., cb : cb + g].contiguous()
    tensor = _f32(buf[..., cb + g :]) if scheme == "nvfp4" else None
    return FormatTensor(codes, scales, tensor, cols, scheme, elem, group_size)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """int codes ``[..., n]`` (each in ``[0, 2**bits)``) -> packed ``uint8 [..., n * bits / 8]``."""
    c = codes.to(torch.int32)
    if bits == 8:
        return c.to(torch.uint8)
    if bits == 4:
        return (c[..., 0::2] | (c[..., 1::2] << 4)).to(torch.uint8)
    w = c[..., 0::4] | (c[..., 1::4] << 6) | (c[..., 2::4] << 12) | (c[..., 3::4] << 18)
    return torch.stack([w & 0xFF, (w >> 8) & 0xFF, (w >> 16) & 0xFF], dim=-1).flatten(-2).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``uint8 [..., m]`` -> int32 codes ``[..., m * 8 / bits]``."""
    p = packed.to(torch.int32)
    if bits == 8:
        return p
    if bits == 4:
        return torch.stack([p & 0xF, p >> 4], dim=-1).flatten(-2)
    b = p.view(*p.shape[:-1], -1, 3)
    w = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    return torch.stack([(w >> s) & 0x3F for s in (0, 6, 12, 18)], dim=-1).flatten(-2)
