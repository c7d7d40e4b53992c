"""Pure-torch reference of the fp8 / MX / NVFP4 formats: the specification that the native CPU
kernels (``cpu_formats.py``) and the Triton kernels (``triton_formats.py``) match bit for bit.
Written to be read, not to be fast; ``format_ops.py`` dispatches to the fast ones.

Public signatures (the fast implementations define the same names without ``_ref``)::

    quantize_fp8_ref(x, elem, group_size, *, rows=1, stochastic=False, seed=0) -> FormatTensor
    quantize_mx_ref(x, elem, *, scale_rule="ocp", rows=1, stochastic=False, seed=0) -> FormatTensor
    quantize_nvfp4_ref(x, *, rows=1, stochastic=False, seed=0) -> FormatTensor
    dequantize_fp8_ref(q, *, out=None, dtype=torch.float32) -> Tensor [rows, cols]
    dequantize_mx_ref(q, *, out=None, dtype=torch.float32) -> Tensor [rows, cols]
    dequantize_nvfp4_ref(q, *, out=None, dtype=torch.float32) -> Tensor [rows, cols]

``x`` is fp32 / bf16 / fp16 of any shape with ``numel`` divisible by ``rows``; ``elem`` a name in
``format_layout.ELEMENTS`` allowed by the scheme; the result a :class:`FormatTensor` whose wire rows
``format_layout.pack`` / ``unpack`` make. Element helpers: :func:`encode_elements`,
:func:`decode_elements`, :func:`encode_e8m0`, :func:`decode_e8m0`.

Arithmetic (all fp32, no FMA, no flush to zero; bf16 / fp16 inputs widened exactly first; each
step exact or one IEEE round-to-nearest-even). Not a ``torch.float8_*`` cast: those round
differently between devices and have no 6- and 4-bit formats.

Element encoding of a scaled value ``v``:
  - sign = ``v``'s sign bit, always copied (``-0`` and negatives that round to zero give the
    negative-zero code, as an IEEE cast does); int8 (two's complement) has no ``-0``.
  - NaN ``v``: the format's NaN code ``0x7F`` (E4M3, E5M2; sign cleared); formats without NaN get
    code 0 (their block's scale carries the NaN, see below).
  - ``a = min(|v|, max)`` (saturating; Inf saturates too, E5M2 included: never an Inf code).
  - ``e = max(floor(log2 a), emin)`` read from ``a``'s fp32 exponent bits (a zero or fp32
    subnormal ``a`` has exponent below ``emin``), ``ulp = 2**(e - mbits)``, ``m = a / ulp`` (exact),
    ``r = round_half_even(m)`` (nearest) or ``floor(m + u)`` (stochastic; ``u`` the Philox uniform
    of ``reference.philox_uniform(seed, offset)`` with ``offset = row * padded_cols + col``, the
    int quantizer's rule), ``a' = min(r * ulp, max)``; ``a'`` is exactly representable and is
    packed into its exponent / mantissa fields (a rounding up to ``2**(e+1)`` lands in the next
    binade by construction).
  - int8 (MX INT8, value ``k / 64``): ``k = clamp(round_half_even(v * 64), -127, 127)`` or
    ``clamp(floor(v * 64 + u), -127, 127)``, stored as its two's-complement byte.

Schemes (per row, blocks of ``group_size`` zero padded; ``absmax`` over a block):
  - ``fp8``: ``s = absmax / max`` (fp32 division), ``v = x / s``; decode ``code_value * s``. A block
    with ``s == 0`` stores zero codes (decodes to +0); a block holding NaN or Inf stores
    ``s = NaN`` and zero codes (decodes to NaN everywhere).
  - ``mx`` (blocks of 32): shared exponent ``k``: ``ocp`` rule ``k = floor(log2 absmax) - emax``;
    ``round_up`` rule ``k = floor(log2 absmax) - emax + (sig * 2**emax > max)`` with
    ``absmax = sig * 2**floor(log2 absmax)``, ``1 <= sig < 2`` (exact for fp32 subnormals too:
    ``torch.frexp``), i.e. the smallest ``k`` with ``absmax <= max * 2**k``. ``k`` is clamped to
    [-127, 127] and stored as E8M0 ``k + 127``. ``v = x * 2**-k``; decode ``code_value * 2**k``.
    A zero block stores E8M0 code 0 and zero codes; a block holding NaN or Inf stores E8M0 255
    and zero codes (decodes to NaN everywhere).
  - ``nvfp4`` (E2M1, blocks of 16): per row ``t = absmax(row) / 2688`` (``6 * 448``, finite values
    only), per block ``b = e4m3_nearest(absmax(block) / 6 / t)`` (two divisions in that order;
    saturating at 448), element scale ``d = decode(b) * t``, ``v = x / d``; decode
    ``code_value * (decode(b) * t)``. ``t == 0`` (an all-zero row) stores ``t = 0``, block codes 0,
    zero codes; a block with ``d == 0`` stores zero codes. A block holding NaN or Inf stores the
    E4M3 NaN code ``0x7F`` as its scale and zero codes: it decodes to NaN, the row's other blocks
    are unaffected. Only the elements round stochastically; ``t`` and ``b`` always round to nearest.
"""

from __future__ import annotations

import torch

from .format_layout import (
    E8M0_NAN,
    ELEMENTS,
    FIXED_GROUP_SIZE,
    NVFP4_TENSOR_DIVISOR,
    ElementFormat,
    FormatTensor,
    check_format_args,
    check_format_tensor,
    check_scale_rule,
    num_groups,
    pack_codes,
    unpack_codes,
)
from .layout import output_buffer
from .reference import philox_uniform


# ----------------------------------------------------------------------------------------------
# Bit-level helpers.
# ----------------------------------------------------------------------------------------------
def pow2(n: torch.Tensor) -> torch.Tensor:
    """``2**n`` as fp32 for int ``n`` in [-149, 127], built from its bits (exact, subnormals too)."""
    n = n.to(torch.int32)
    normal = (n + 127).clamp(min=1) << 23
    sub = torch.ones_like(n) << (n + 149).clamp(0, 22)
    return torch.where(n >= -126, normal, sub).view(torch.float32)


def exponent(a: torch.Tensor) -> torch.Tensor:
    """``floor(log2 a)`` of non-negative fp32 ``a`` from its exponent bits (-127 for 0 and subnormals)."""
    return ((a.view(torch.int32) >> 23) & 0xFF) - 127


def _uniforms(seed: int, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Philox uniforms for a ``[rows, padded_cols]``-ordered block tensor of ``shape``."""
    n = 1
    for d in shape:
        n *= d
    offs = torch.arange(n, dtype=torch.int64).view(shape)
    return philox_uniform(seed, offs).to(device)


# ----------------------------------------------------------------------------------------------
# Elements.
# ----------------------------------------------------------------------------------------------
def encode_elements(v: torch.Tensor, elem: str, u: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled fp32 values -> int32 codes of ``elem`` (module docstring); ``u``: stochastic uniforms."""
    f = ELEMENTS[elem]
    v = v.to(torch.float32)
    if f.is_int:
        t = v * 64.0
        r = torch.round(t) if u is None else torch.floor(t + u)
        r = torch.where(torch.isnan(r), torch.zeros_like(r), r).clamp(-127, 127)
        return r.to(torch.int32) & 0xFF
    sign = torch.signbit(v).to(torch.int32)
    nan = torch.isnan(v)
    a = torch.where(nan, torch.zeros_like(v), v.abs()).clamp(max=f.max)
    e = exponent(a).clamp(min=f.emin)
    ulp = pow2(e - f.mbits)
    m = a / ulp
    r = torch.round(m) if u is None else torch.floor(m + u)
    a = torch.minimum(r * ulp, torch.tensor(f.max))
    return _pack_value(a, sign, nan, f)


def _pack_value(a: torch.Tensor, sign: torch.Tensor, nan: torch.Tensor, f: ElementFormat) -> torch.Tensor:
    """An exactly representable magnitude ``a`` -> its exponent / mantissa fields with ``sign``."""
    ea = exponent(a)
    sub = ea < f.emin
    exp_field = torch.where(sub, torch.zeros_like(ea), ea + f.bias)
    sig = a / pow2(torch.where(sub, torch.full_like(ea, f.emin), ea) - f.mbits)  # exact integer
    mant = sig.to(torch.int32) - torch.where(sub, 0, 1 << f.mbits)
    code = (sign << (f.ebits + f.mbits)) | (exp_field << f.mbits) | mant
    if f.nan_code is not None:
        code = torch.where(nan, torch.full_like(code, f.nan_code), code)
    return code


def decode_elements(codes: torch.Tensor, elem: str) -> torch.Tensor:
    """int codes of ``elem`` -> fp32 values (exact)."""
    f = ELEMENTS[elem]
    c = codes.to(torch.int32) & ((1 << f.bits) - 1)
    if f.is_int:
        return torch.where(c >= 128, c - 256, c).to(torch.float32) * (1.0 / 64.0)
    sign = (c >> (f.ebits + f.mbits)) & 1
    exp_field = (c >> f.mbits) & ((1 << f.ebits) - 1)
    mant = c & ((1 << f.mbits) - 1)
    normal = exp_field > 0
    sig = torch.where(normal, mant + (1 << f.mbits), mant)
    e = torch.where(normal, exp_field - f.bias, torch.full_like(exp_field, f.emin))
    val = sig.to(torch.float32) * pow2(e - f.mbits)
    val = torch.where(sign.bool(), -val, val)
    if f.name == "e4m3":
        val = torch.where((c & 0x7F) == 0x7F, torch.full_like(val, float("nan")), val)
    elif f.name == "e5m2":
        top = exp_field == 31
        val = torch.where(top & (mant == 0), torch.where(sign.bool(), -torch.inf, torch.inf), val)
        val = torch.where(top & (mant != 0), torch.full_like(val, float("nan")), val)
    return val


def encode_e8m0(k: torch.Tensor) -> torch.Tensor:
    """Shared exponents ``k`` (int) -> E8M0 codes ``clamp(k, -127, 127) + 127`` (int32)."""
    return k.to(torch.int32).clamp(-127, 127) + 127


def decode_e8m0(codes: torch.Tensor) -> torch.Tensor:
    """E8M0 codes -> fp32 ``2**(code - 127)``; code 255 -> NaN."""
    c = codes.to(torch.int32)
    x = pow2((c - 127).clamp(max=127))
    return torch.where(c == E8M0_NAN, torch.full_like(x, float("nan")), x)


# ----------------------------------------------------------------------------------------------
# Blocks.
# ----------------------------------------------------------------------------------------------
def _blocks(x: torch.Tensor, rows: int, cols: int, group_size: int) -> torch.Tensor:
    """x -> fp32 ``[rows, groups, group_size]``, zero padded."""
    g = num_groups(cols, group_size)
    v = torch.zeros(rows, g * group_size, dtype=torch.float32, device=x.device)
    v[:, :cols] = x.reshape(rows, cols)
    return v.view(rows, g, group_size)


def _finite_absmax(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(all finite, absmax of the finite values)`` over the last dim."""
    fin = torch.isfinite(v)
    return fin.all(dim=-1), torch.where(fin, v.abs(), torch.zeros_like(v)).amax(dim=-1)


def _encode_rows(v: torch.Tensor, elem: str, ok: torch.Tensor, stochastic: bool, seed: int) -> torch.Tensor:
    """Scaled blocks ``[rows, groups, gs]`` -> packed codes ``[rows, code_bytes]``; blocks where
    ``ok`` is False store zero codes."""
    u = _uniforms(seed, tuple(v.shape), v.device) if stochastic else None
    codes = encode_elements(v, elem, u)
    codes = torch.where(ok.unsqueeze(-1), codes, torch.zeros_like(codes))
    return pack_codes(codes.reshape(v.shape[0], -1), ELEMENTS[elem].bits)


def _element_values(q: FormatTensor) -> torch.Tensor:
    """q's element values, fp32 ``[rows, groups, group_size]``."""
    c = unpack_codes(q.codes, ELEMENTS[q.elem].bits)
    return decode_elements(c, q.elem).view(q.rows, num_groups(q.cols, q.group_size), q.group_size)


def _write_out(full: torch.Tensor, cols: int, out: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``[rows, groups, group_size]`` fp32 -> ``[rows, cols]`` in ``dtype`` (into ``out`` if given)."""
    rows = full.shape[0]
    dst = output_buffer(out, rows, cols, dtype, full.device)
    dst.view(rows, cols).copy_(full.reshape(rows, -1)[:, :cols])
    return dst


# ----------------------------------------------------------------------------------------------
# fp8: one fp32 scale per group.
# ----------------------------------------------------------------------------------------------
def quantize_fp8_ref(
    x: torch.Tensor, elem: str, group_size: int, *, rows: int = 1, stochastic: bool = False, seed: int = 0
) -> FormatTensor:
    """E4M3 / E5M2 elements, one fp32 scale ``absmax / max`` per ``group_size`` elements."""
    cols, seed = check_format_args(x, "fp8", elem, group_size, rows, seed)
    v = _blocks(x, rows, cols, group_size)
    finite, absmax = _finite_absmax(v)
    s = absmax / torch.tensor(ELEMENTS[elem].max, dtype=torch.float32)
    ok = finite & (s > 0)
    safe = torch.where(ok, s, torch.ones_like(s)).unsqueeze(-1)
    codes = _encode_rows(v / safe, elem, ok, stochastic, seed)
    scales = torch.where(finite, s, torch.full_like(s, float("nan")))
    return FormatTensor(codes, scales, None, cols, "fp8", elem, group_size)


def dequantize_fp8_ref(
    q: FormatTensor, *, out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """fp8 FormatTensor ``[rows, *]`` -> ``[rows, cols]``: ``code_value * scale``."""
    check_format_tensor(q, "fp8")
    return _write_out(_element_values(q) * q.scales.unsqueeze(-1), q.cols, out, dtype)


# ----------------------------------------------------------------------------------------------
# mx: blocks of 32 sharing one E8M0 power-of-two scale.
# ----------------------------------------------------------------------------------------------
def mx_exponents(absmax: torch.Tensor, elem: str, scale_rule: str) -> torch.Tensor:
    """Shared exponents ``k`` (int32, unclamped) of blocks with ``absmax > 0`` (module docstring)."""
    f = ELEMENTS[elem]
    mant, ex = torch.frexp(absmax)  # absmax = mant * 2**ex, 0.5 <= mant < 1 (exact, subnormals too)
    k = ex.to(torch.int32) - 1 - f.emax
    if scale_rule == "round_up":
        sig_scaled = mant * float(2 ** (f.emax + 1))  # sig * 2**emax, exact
        k = k + (sig_scaled > f.max).to(torch.int32)
    return k


def quantize_mx_ref(
    x: torch.Tensor, elem: str, *, scale_rule: str = "ocp", rows: int = 1, stochastic: bool = False, seed: int = 0
) -> FormatTensor:
    """MX: ``elem`` elements in blocks of 32, one E8M0 shared exponent per block."""
    gs = FIXED_GROUP_SIZE["mx"]
    cols, seed = check_format_args(x, "mx", elem, gs, rows, seed)
    check_scale_rule(scale_rule)
    v = _blocks(x, rows, cols, gs)
    finite, absmax = _finite_absmax(v)
    nonzero = absmax > 0
    k = mx_exponents(torch.where(nonzero, absmax, torch.ones_like(absmax)), elem, scale_rule).clamp(-127, 127)
    code = torch.where(nonzero, encode_e8m0(k), torch.zeros_like(k))
    code = torch.where(finite, code, torch.full_like(code, E8M0_NAN))
    ok = finite & nonzero
    scaled = v * pow2(torch.where(ok, -k, torch.zeros_like(k))).unsqueeze(-1)
    codes = _encode_rows(scaled, elem, ok, stochastic, seed)
    return FormatTensor(codes, code.to(torch.uint8), None, cols, "mx", elem, gs)


def dequantize_mx_ref(
    q: FormatTensor, *, out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """mx FormatTensor ``[rows, *]`` -> ``[rows, cols]``: ``code_value * 2**(e8m0 - 127)``."""
    check_format_tensor(q, "mx")
    return _write_out(_element_values(q) * decode_e8m0(q.scales).unsqueeze(-1), q.cols, out, dtype)


# ----------------------------------------------------------------------------------------------
# nvfp4: E2M1 in blocks of 16, E4M3 block scales, one fp32 scale per row.
# ----------------------------------------------------------------------------------------------
def _nvfp4_element_scales(b: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """E4M3 block-scale codes ``[rows, groups]`` and row scales ``[rows, 1]`` -> ``decode(b) * t``."""
    return decode_elements(b, "e4m3") * t


def quantize_nvfp4_ref(x: torch.Tensor, *, rows: int = 1, stochastic: bool = False, seed: int = 0) -> FormatTensor:
    """NVFP4: E2M1 elements, an E4M3 scale per 16 and an fp32 scale per row."""
    gs = FIXED_GROUP_SIZE["nvfp4"]
    cols, seed = check_format_args(x, "nvfp4", "e2m1", gs, rows, seed)
    v = _blocks(x, rows, cols, gs)
    finite, absmax = _finite_absmax(v)  # [rows, groups]
    t = absmax.amax(dim=-1, keepdim=True) if absmax.shape[-1] else absmax.new_zeros(rows, 1)
    t = t / torch.tensor(NVFP4_TENSOR_DIVISOR, dtype=torch.float32)  # [rows, 1]
    tpos = t > 0
    ratio = absmax / torch.tensor(6.0) / torch.where(tpos, t, torch.ones_like(t))
    b = encode_elements(ratio, "e4m3")  # saturating, nearest
    b = torch.where(tpos, b, torch.zeros_like(b))
    d = _nvfp4_element_scales(b, t)
    ok = finite & (d > 0)
    safe = torch.where(ok, d, torch.ones_like(d)).unsqueeze(-1)
    codes = _encode_rows(v / safe, "e2m1", ok, stochastic, seed)
    b = torch.where(finite, b, torch.full_like(b, 0x7F))
    return FormatTensor(codes, b.to(torch.uint8), t, cols, "nvfp4", "e2m1", gs)


def dequantize_nvfp4_ref(
    q: FormatTensor, *, out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """nvfp4 FormatTensor ``[rows, *]`` -> ``[rows, cols]``: ``code_value * (decode(b) * t)``."""
    check_format_tensor(q, "nvfp4")
    assert q.tensor_scales is not None  # FormatTensor's check: nvfp4 always has them
    d = _nvfp4_element_scales(q.scales, q.tensor_scales)
    return _write_out(_element_values(q) * d.unsqueeze(-1), q.cols, out, dtype)
