"""Triton element arithmetic of the float formats (E4M3, E5M2, E3M2, E2M3, E2M1, MX INT8), and
the tile helpers built on it (encode / decode by format, packed 8 / 6 / 4-bit code load and store).

Inlined into the kernels of ``_triton_format_kernels.py``. Every step is integer arithmetic on the
fp32 bits, an exact operation, or one IEEE round-to-nearest-even, so that a GPU and the interpreter
produce the bits of the torch reference (``format_reference.py``):

- no ``tl.float8`` casts: their rounding, saturation and NaN handling differ between devices and
  Triton versions;
- powers of two are built from exponent bits (``pow2``), so ``a * 2**k`` is exact whenever the
  result is a normal fp32 (no ``exp2`` approximation);
- round-half-to-even is written with ``floor`` and a comparison of the exact fractional part
  (``rne``) rather than a libdevice ``rint``, so the interpreter and the GPU run the same
  operations;
- NaN never reaches ``tl.minimum`` / ``tl.maximum``: the GPU's ``min.f32`` drops a NaN operand
  and numpy's propagates it, so NaN lanes are replaced first and their codes chosen by mask.

The kernels are launched with ``_triton.LAUNCH_OPTS`` (no FMA contraction, no flush-to-zero of
subnormals), which these helpers rely on: a subnormal scaled value must reach the encoder intact.
"""

from __future__ import annotations

from ._triton import FLT_MAX, jit, stochastic_uniform, tl


@jit
def widen(v):
    """A loaded fp32 / bf16 / fp16 tile -> fp32, exactly. bf16 is widened on its bits (``<< 16``):
    the interpreter's bf16 conversion mangles subnormals (the GPU's is exact either way)."""
    if v.dtype == tl.bfloat16:
        return (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return v.to(tl.float32)


@jit
def narrow(val, OUT_DTYPE: tl.constexpr):
    """fp32 -> OUT_DTYPE rounding to nearest even, as torch's ``.to`` does. bf16 is rounded and
    narrowed on the bits (``_triton.to_out_dtype``'s rounding, then ``>> 16`` instead of a cast:
    the interpreter's bf16 conversion mangles subnormals); NaN stays the quiet NaN it was."""
    if tl.bfloat16 == OUT_DTYPE:
        bits = val.to(tl.uint32, bitcast=True)
        bits = tl.where(val == val, bits + (0x7FFF + ((bits >> 16) & 1)), bits)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return val.to(OUT_DTYPE)


@jit
def pow2(k):
    """2**k as fp32 for int32 ``k`` in [-149, 127], exact (subnormal for k < -126)."""
    normal = (tl.maximum(k, -126) + 127) << 23
    sub = tl.full(k.shape, 1, tl.int32) << (tl.minimum(tl.maximum(k + 149, 0), 22))
    return tl.where(k >= -126, normal, sub).to(tl.float32, bitcast=True)


@jit
def exponent_of(a):
    """floor(log2 a) of a non-negative finite fp32 read from its exponent bits: -127 for zero and
    for every subnormal (callers clamp it to an exponent above that)."""
    return ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@jit
def rne(m):
    """Round fp32 ``m`` half to even, as an fp32 integer. ``m - floor(m)`` is exact for every fp32,
    so the comparison with 0.5 decides the ties without a second rounding."""
    fl = tl.floor(m)
    fr = m - fl
    odd = (fl - 2.0 * tl.floor(fl * 0.5)) != 0.0
    up = (fr > 0.5) | ((fr == 0.5) & odd)
    return tl.where(up, fl + 1.0, fl)


@jit
def encode_float(
    v,  # fp32 scaled values, any shape (NaN allowed)
    u,  # fp32 uniforms in [0, 1) of the same shape (read only if STOCHASTIC)
    E: tl.constexpr,  # exponent bits
    M: tl.constexpr,  # mantissa bits
    BIAS: tl.constexpr,
    MAX_MAG: tl.constexpr,  # largest finite magnitude code, e.g. 0x7E for E4M3
    MAX_VAL: tl.constexpr,  # its value, e.g. 448.0
    NAN_MAG: tl.constexpr,  # magnitude code of NaN (-1: the format has none; NaN encodes as 0)
    STOCHASTIC: tl.constexpr,
):
    """fp32 -> int32 codes ``sign << (E + M) | magnitude`` (saturating, RNE or stochastic).

    The quantum of ``a = |v|`` is ``2**(e - M)`` with ``e = max(floor(log2 a), 1 - BIAS)``;
    ``r = round(a / quantum)`` and the magnitude code is ``(e - emin) * 2**M + r``: the same formula
    for subnormals (e = emin, r < 2**M), normals, and an ``r`` that rounded up to ``2**(M + 1)``
    (which is then exactly the next binade's first code). A code past ``MAX_MAG`` saturates.
    """
    EMIN: tl.constexpr = 1 - BIAS
    sign = (v.to(tl.int32, bitcast=True) >> 31) & 1
    nan = v != v
    a = tl.where(nan, 0.0, tl.abs(v))
    a = tl.minimum(a, MAX_VAL)  # +-Inf saturates
    e = tl.maximum(exponent_of(a), EMIN)
    m = a * pow2(M - e)  # exact: a power-of-two scaling of a normal result
    if STOCHASTIC:
        r = tl.floor(m + u)
    else:
        r = rne(m)
    mag = (e - EMIN) * (1 << M) + r.to(tl.int32)
    mag = tl.minimum(mag, MAX_MAG)
    code = (sign << (E + M)) | mag
    if NAN_MAG >= 0:
        code = tl.where(nan, NAN_MAG, code)  # the NaN code has its sign bit clear
    return code


@jit
def decode_float(
    code,  # int32 codes in [0, 2**(1 + E + M))
    E: tl.constexpr,
    M: tl.constexpr,
    BIAS: tl.constexpr,
    NAN_MAG: tl.constexpr,  # magnitude code of NaN, -1 if none
    IEEE_SPECIALS: tl.constexpr,  # the top exponent is Inf (mantissa 0) / NaN (E5M2)
):
    """int32 codes -> exact fp32 values (``r * 2**(e - M)``, signed; Inf codes as such, NaN codes
    as the canonical positive quiet NaN whatever their sign bit)."""
    EMIN: tl.constexpr = 1 - BIAS
    mag = code & ((1 << (E + M)) - 1)
    ef = mag >> M
    r = (mag & ((1 << M) - 1)) + tl.where(ef > 0, 1 << M, 0)
    e = tl.maximum(ef - BIAS, EMIN)
    val = r.to(tl.float32) * pow2(e - M)
    nan = tl.full(val.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    if IEEE_SPECIALS:
        top = ef == (1 << E) - 1
        inf = tl.full(val.shape, 0x7F800000, tl.int32).to(tl.float32, bitcast=True)
        val = tl.where(top, inf, val)
    # the sign as a bit, not a negation: Triton 3.6 compiles ``-x`` as ``0 - x``, which makes the
    # code of -0.0 decode to +0.0 (the interpreter and newer Triton negate exactly)
    sign = ((code >> (E + M)) & 1).to(tl.uint32) << 31
    val = (val.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    if IEEE_SPECIALS:
        val = tl.where((ef == (1 << E) - 1) & ((mag & ((1 << M) - 1)) != 0), nan, val)
    elif NAN_MAG >= 0:
        val = tl.where(mag == NAN_MAG, nan, val)
    return val


@jit
def encode_int8(v, u, STOCHASTIC: tl.constexpr):
    """MX INT8: fp32 scaled values -> int32 ``k`` in [-127, 127], value ``k / 64`` (NaN -> 0)."""
    w = v * 64.0  # exact: a power-of-two scaling
    w = tl.where(w != w, 0.0, w)
    if STOCHASTIC:
        k = tl.floor(w + u)
    else:
        k = rne(w)
    k = tl.minimum(tl.maximum(k, -127.0), 127.0)
    return k.to(tl.int32)


@jit
def decode_int8(code):
    """int32 two's-complement byte values (0..255) -> exact fp32 ``k / 64``."""
    k = tl.where(code >= 128, code - 256, code)
    return k.to(tl.float32) * 0.015625


# ----------------------------------------------------------------------------------------------
# Tile helpers.
# ----------------------------------------------------------------------------------------------
@jit
def nan_f32(shape):
    """A tile of the canonical quiet NaN (0x7FC00000), the reference's ``float("nan")``."""
    return tl.full(shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)


@jit
def tile_encode(
    v,
    offs,
    seed,
    INT8: tl.constexpr,
    E: tl.constexpr,
    M: tl.constexpr,
    BIAS: tl.constexpr,
    MAX_MAG: tl.constexpr,
    MAX_VAL: tl.constexpr,
    NAN_MAG: tl.constexpr,
    STOCHASTIC: tl.constexpr,
):
    """Scaled fp32 values -> int32 element codes (the byte value of the code, 0 .. 2**bits - 1)."""
    if STOCHASTIC:
        u = stochastic_uniform(seed, offs)
    else:
        u = v  # unread
    if INT8:
        return encode_int8(v, u, STOCHASTIC) & 0xFF
    else:
        return encode_float(v, u, E, M, BIAS, MAX_MAG, MAX_VAL, NAN_MAG, STOCHASTIC)


@jit
def tile_decode(
    c,
    INT8: tl.constexpr,
    E: tl.constexpr,
    M: tl.constexpr,
    BIAS: tl.constexpr,
    NAN_MAG: tl.constexpr,
    IEEE: tl.constexpr,
):
    """int32 element codes -> exact fp32 element values."""
    if INT8:
        return decode_int8(c)
    else:
        return decode_float(c, E, M, BIAS, NAN_MAG, IEEE)


@jit
def store_codes(
    row_ptr,  # *uint8: first code byte of this row
    c,  # [BG, BGS] int32 codes (BITS wide)
    g,  # [BG] int64 block indices
    groups,
    GROUP_SIZE: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_GS: tl.constexpr,
):
    """Pack a tile's codes: 8 bits one byte each; 6 bits four codes in three bytes (little-endian
    24-bit word ``c0 | c1 << 6 | c2 << 12 | c3 << 18``); 4 bits two per byte, low nibble first.
    Packed widths need ``GROUP_SIZE == BLOCK_GS`` (MX and NVFP4 blocks are powers of two)."""
    if BITS == 8:
        j = tl.arange(0, BLOCK_GS)
        mask = (j[None, :] < GROUP_SIZE) & (g[:, None] < groups)
        tl.store(row_ptr + g[:, None] * GROUP_SIZE + j[None, :], c.to(tl.uint8), mask=mask)
    elif BITS == 6:
        i = tl.arange(0, BLOCK_GS // 4)
        mask = g[:, None] < groups
        pairs_lo, pairs_hi = tl.split(tl.reshape(c, (BLOCK_G, BLOCK_GS // 4, 2, 2)))  # 4i+2p, 4i+2p+1
        c0, c2 = tl.split(pairs_lo)
        c1, c3 = tl.split(pairs_hi)
        word = c0 | (c1 << 6) | (c2 << 12) | (c3 << 18)
        base = row_ptr + g[:, None] * (GROUP_SIZE * 3 // 4) + 3 * i[None, :]
        tl.store(base, (word & 0xFF).to(tl.uint8), mask=mask)
        tl.store(base + 1, ((word >> 8) & 0xFF).to(tl.uint8), mask=mask)
        tl.store(base + 2, ((word >> 16) & 0xFF).to(tl.uint8), mask=mask)
    else:
        i = tl.arange(0, BLOCK_GS // 2)
        mask = g[:, None] < groups
        lo, hi = tl.split(tl.reshape(c, (BLOCK_G, BLOCK_GS // 2, 2)))
        tl.store(row_ptr + g[:, None] * (GROUP_SIZE // 2) + i[None, :], (lo | (hi << 4)).to(tl.uint8), mask=mask)


@jit
def load_codes(
    row_ptr,  # *uint8: first code byte of this row
    g,  # [BG] int64 block indices
    groups,
    GROUP_SIZE: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_GS: tl.constexpr,
):
    """Inverse of ``store_codes``: int32 codes [BG, BGS] (0 outside the row's blocks)."""
    if BITS == 8:
        j = tl.arange(0, BLOCK_GS)
        mask = (j[None, :] < GROUP_SIZE) & (g[:, None] < groups)
        return tl.load(row_ptr + g[:, None] * GROUP_SIZE + j[None, :], mask=mask, other=0).to(tl.int32)
    elif BITS == 6:
        i = tl.arange(0, BLOCK_GS // 4)
        mask = g[:, None] < groups
        base = row_ptr + g[:, None] * (GROUP_SIZE * 3 // 4) + 3 * i[None, :]
        b0 = tl.load(base, mask=mask, other=0).to(tl.int32)
        b1 = tl.load(base + 1, mask=mask, other=0).to(tl.int32)
        b2 = tl.load(base + 2, mask=mask, other=0).to(tl.int32)
        word = b0 | (b1 << 8) | (b2 << 16)
        lo = tl.join(word & 0x3F, (word >> 12) & 0x3F)  # [.., 2]: c0, c2
        hi = tl.join((word >> 6) & 0x3F, (word >> 18) & 0x3F)  # c1, c3
        return tl.reshape(tl.join(lo, hi), (BLOCK_G, BLOCK_GS))  # [i, p, q] -> 4i + 2p + q
    else:
        i = tl.arange(0, BLOCK_GS // 2)
        mask = g[:, None] < groups
        b = tl.load(row_ptr + g[:, None] * (GROUP_SIZE // 2) + i[None, :], mask=mask, other=0).to(tl.int32)
        return tl.reshape(tl.join(b & 0xF, b >> 4), (BLOCK_G, BLOCK_GS))


@jit
def tile_absmax(v):
    """Per block of a [BG, BGS] tile: (absmax of the finite values, all finite?). Finiteness is
    tested explicitly rather than trusting ``tl.max`` to propagate NaN."""
    fin = tl.abs(v) <= FLT_MAX
    finite = tl.sum((fin == 0).to(tl.int32), axis=1) == 0
    return tl.max(tl.where(fin, tl.abs(v), 0.0), axis=1), finite
