"""Triton kernels of the float wire formats: ``fp8`` (E4M3 / E5M2, fp32 group scale), ``mx`` (OCP
microscaling: MXFP8, MXFP6, MXFP4, MXINT8 in blocks of 32 with an E8M0 scale) and ``nvfp4`` (E2M1 in
blocks of 16 with an E4M3 block scale and an fp32 row scale). Launched by ``triton_formats.py``.

Each kernel reproduces ``format_reference.py`` bit for bit (same code bytes, same scale bits, same
output bits). The tile is the int kernels' (``_triton.tile_coords``: ``BLOCK_G`` blocks of one
row per program), and so are the rules that keep the GPU exact: IEEE divisions (``div_rn``), no FMA
contraction and no flush-to-zero (``_triton.LAUNCH_OPTS``), and stochastic rounding with the
Philox uniforms of the padded-layout position ``row * groups * block + col``
(``_triton.stochastic_uniform``). The element encoders are
integer arithmetic on the fp32 bits (``_triton_elems.py``), never a ``tl.float8`` cast.
"""

from __future__ import annotations

from ._triton import jit, tile_coords, tl
from ._triton_elems import (
    decode_float,
    encode_float,
    exponent_of,
    load_codes,
    nan_f32,
    narrow,
    pow2,
    store_codes,
    tile_absmax,
    tile_decode,
    tile_encode,
    widen,
)


# ----------------------------------------------------------------------------------------------
# Kernels. One program = BLOCK_G consecutive blocks of one row. The element format arrives as
# constexprs (INT8, E, M, BIAS, MAX_MAG, MAX_VAL, NAN_MAG, IEEE; see ``ElementFormat``).
# ----------------------------------------------------------------------------------------------
@jit
def _fp8_quantize_kernel(
    x_ptr,  # *fp32 / *bf16 / *fp16 [rows, cols], rows x_stride apart
    codes_ptr,  # *uint8 [rows, groups * GROUP_SIZE], output
    scales_ptr,  # *fp32 [rows, groups], output
    cols,
    groups,
    x_stride,
    codes_stride,
    scales_stride,
    tiles_per_row,
    seed,
    GROUP_SIZE: tl.constexpr,
    E: tl.constexpr,
    M: tl.constexpr,
    BIAS: tl.constexpr,
    MAX_MAG: tl.constexpr,
    MAX_VAL: tl.constexpr,
    NAN_MAG: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_GS: tl.constexpr,
):
    """Group scale ``s = absmax / MAX_VAL``; elements ``x / s`` (zero group: s = 0, codes 0;
    non-finite group: s = NaN, codes 0)."""
    row, g, j, col = tile_coords(tiles_per_row, GROUP_SIZE, BLOCK_G, BLOCK_GS)
    in_block = (j[None, :] < GROUP_SIZE) & (g[:, None] < groups)
    v = widen(tl.load(x_ptr + row * x_stride + col, mask=in_block & (col < cols), other=0.0))
    fp8_encode_tile(
        v,
        row,
        g,
        col,
        groups,
        codes_ptr + row * codes_stride,
        scales_ptr + row * scales_stride,
        seed,
        GROUP_SIZE,
        E,
        M,
        BIAS,
        MAX_MAG,
        MAX_VAL,
        NAN_MAG,
        STOCHASTIC,
        BLOCK_G,
        BLOCK_GS,
    )


@jit
def fp8_encode_tile(
    v,  # [BG, BGS] fp32: the tile's values, 0 outside the row's blocks and past its end
    row,
    g,
    col,
    groups,
    codes_row_ptr,  # *uint8: this row's first code byte
    scales_row_ptr,  # *fp32: this row's first group scale
    seed,
    GROUP_SIZE: tl.constexpr,
    E: tl.constexpr,
    M: tl.constexpr,
    BIAS: tl.constexpr,
    MAX_MAG: tl.constexpr,
    MAX_VAL: tl.constexpr,
    NAN_MAG: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_GS: tl.constexpr,
):
    """fp8 quantization of a loaded tile (``_fp8_quantize_kernel``'s rule), its codes and scales stored."""
    absmax, finite = tile_absmax(v)
    s = tl.math.div_rn(absmax, tl.full(absmax.shape, MAX_VAL, tl.float32))
    safe = tl.where(s > 0.0, s, 1.0)
    t = tl.math.div_rn(v, tl.broadcast_to(safe[:, None], v.shape))
    offs = row * groups * GROUP_SIZE + col
    c = tile_encode(t, offs, seed, False, E, M, BIAS, MAX_MAG, MAX_VAL, NAN_MAG, STOCHASTIC)
    c = tl.where((finite & (s > 0.0))[:, None], c, 0)
    tl.store(scales_row_ptr + g, tl.where(finite, s, nan_f32(s.shape)), mask=g < groups)
    store_codes(codes_row_ptr, c, g, groups, GROUP_SIZE, 8, BLOCK_G, BLOCK_GS)


@jit
def _fp8_dequantize_kernel(
    codes_ptr,  # *uint8 [rows, groups * GROUP_SIZE]
    scales_ptr,  # *fp32 [rows, groups]
    out_ptr,  # *fp32 / *bf16 / *fp16 [rows, cols]
    cols,
    groups,
    codes_stride,
    scales_stride,
    out_stride,
    tiles_per_row,
    GROUP_SIZE: tl.constexpr,
    E: tl.constexpr,
    M: tl.constexpr,
    BIAS: tl.constexpr,
    NAN_MAG: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_GS: tl.constexpr,
):
    row, g, j, col = tile_coords(tiles_per_row, GROUP_SIZE, BLOCK_G, BLOCK_GS)
    c = load_codes(codes_ptr + row * codes_stride, g, groups, GROUP_SIZE, 8, BLOCK_G, BLOCK_GS)
    s = tl.load(scales_ptr + row * scales_stride + g, mask=g < groups, other=0.0)
    val = tile_decode(c, False, E, M, BIAS, NAN_MAG, IEEE) * s[:, None]
    mask = (j[None, :] < GROUP_SIZE) & (col < cols)
    tl.store(out_ptr + row * out_stride + col, narrow(val, out_ptr.dtype.element_ty), mask=mask)


@jit
def _mx_quantize_kernel(
    x_ptr,  # *fp32 / *bf16 / *fp16 [rows, cols], rows x_stride apart
    codes_ptr,  # *uint8 [rows, groups * GROUP_SIZE * BITS / 8], output
    scales_ptr,  # *uint8 [rows, groups] E8M0, output
    cols,
    groups,
    x_stride,
    codes_stride,
    scales_stride,
    tiles_per_row,
    seed,
    GROUP_SIZE: tl.constexpr,
    BITS: tl.constexpr,
    INT8: tl.constexpr,
    E: tl.constexpr,
    M: tl.constexpr,
    BIAS: tl.constexpr,
    MAX_MAG: tl.constexpr,
    MAX_VAL: tl.constexpr,
    NAN_MAG: tl.constexpr,
    EMAX: tl.constexpr,  # exponent of the element format's largest normal
    MAX_MANT: tl.constexpr,  # fp32 mantissa bits of MAX_VAL (the round-up rule compares against them)
    ROUND_UP: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_GS: tl.constexpr,
):
    """Shared exponent ``floor(log2 absmax) - EMAX`` (OCP) or the smallest one with
    ``absmax / 2**exp <= MAX_VAL`` (round-up), stored as E8M0 (``exp + 127`` clamped to [0, 254]);
    255 (NaN) for a block with NaN or Inf. ``absmax / 2**(floor(log2 absmax) - EMAX)`` lies in
    [2**EMAX, 2**(EMAX + 1)) as MAX_VAL does, so round-up adds one exactly when absmax's mantissa
    exceeds MAX_VAL's (compared on the bits of absmax normalised by 2**64 where it is an fp32
    subnormal, so its exponent and mantissa are exact as ``torch.frexp``'s). A zero block stores
    E8M0 code 0 and zero codes."""
    row, g, j, col = tile_coords(tiles_per_row, GROUP_SIZE, BLOCK_G, BLOCK_GS)
    in_block = (j[None, :] < GROUP_SIZE) & (g[:, None] < groups)
    v = widen(tl.load(x_ptr + row * x_stride + col, mask=in_block & (col < cols), other=0.0))
    mx_encode_tile(
        v,
        row,
        g,
        col,
        groups,
        codes_ptr + row * codes_stride,
        scales_ptr + row * scales_stride,
        seed,
        GROUP_SIZE,
        BITS,
        INT8,
        E,
        M,
        BIAS,
        MAX_MAG,
        MAX_VAL,
        NAN_MAG,
        EMAX,
        MAX_MANT,
        ROUND_UP,
        STOCHASTIC,
        BLOCK_G,
        BLOCK_GS,
    )


@jit
def mx_encode_tile(
    v,  # [BG, BGS] fp32: the tile's values, 0 outside the row's blocks and past its end
    row,
    g,
    col,
    groups,
    codes_row_ptr,  # *uint8: this row's first code byte
    scales_row_ptr,  # *uint8: this row's first E8M0 scale
    seed,
    GROUP_SIZE: tl.constexpr,
    BITS: tl.constexpr,
    INT8: tl.constexpr,
    E: tl.constexpr,
    M: tl.constexpr,
    BIAS: tl.constexpr,
    MAX_MAG: tl.constexpr,
    MAX_VAL: tl.constexpr,
    NAN_MAG: tl.constexpr,
    EMAX: tl.constexpr,
    MAX_MANT: tl.constexpr,
    ROUND_UP: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_GS: tl.constexpr,
):
    """MX quantization of a loaded tile (``_mx_quantize_kernel``'s rule), its codes and scales stored."""
    absmax, finite = tile_absmax(v)
    sub = absmax < 1.1754943508222875e-38  # fp32 subnormal (or zero): normalise it exactly first
    an = tl.where(sub, absmax * 18446744073709551616.0, absmax)  # * 2**64
    ex = exponent_of(an) - tl.where(sub, 64, 0)  # floor(log2 absmax), subnormals included
    exp = ex - EMAX
    if ROUND_UP:
        exp = exp + ((an.to(tl.int32, bitcast=True) & 0x7FFFFF) > MAX_MANT).to(tl.int32)
    exp = tl.minimum(tl.maximum(exp, -127), 127)
    ok = finite & (absmax > 0.0)
    # exact unless the result is an fp32 subnormal (one rounding); 0 - exp: an int32 negation written as
    # a subtraction (tests/unit/test_kernels_triton_source.py allows no unary minus in @jit code)
    t = v * pow2(0 - exp)[:, None]
    offs = row * groups * GROUP_SIZE + col
    c = tile_encode(t, offs, seed, INT8, E, M, BIAS, MAX_MAG, MAX_VAL, NAN_MAG, STOCHASTIC)
    c = tl.where(ok[:, None], c, 0)
    sc = tl.where(finite, tl.where(absmax > 0.0, exp + 127, 0), 255)
    tl.store(scales_row_ptr + g, sc.to(tl.uint8), mask=g < groups)
    store_codes(codes_row_ptr, c, g, groups, GROUP_SIZE, BITS, BLOCK_G, BLOCK_GS)


@jit
def _mx_dequantize_kernel(
    codes_ptr,  # *uint8 [rows, groups * GROUP_SIZE * BITS / 8]
    scales_ptr,  # *uint8 [rows, groups] E8M0
    out_ptr,  # *fp32 / *bf16 / *fp16 [rows, cols]
    cols,
    groups,
    codes_stride,
    scales_stride,
    out_stride,
    tiles_per_row,
    GROUP_SIZE: tl.constexpr,
    BITS: tl.constexpr,
    INT8: tl.constexpr,
    E: tl.constexpr,
    M: tl.constexpr,
    BIAS: tl.constexpr,
    NAN_MAG: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_GS: tl.constexpr,
):
    row, g, j, col = tile_coords(tiles_per_row, GROUP_SIZE, BLOCK_G, BLOCK_GS)
    c = load_codes(codes_ptr + row * codes_stride, g, groups, GROUP_SIZE, BITS, BLOCK_G, BLOCK_GS)
    sc = tl.load(scales_ptr + row * scales_stride + g, mask=g < groups, other=0).to(tl.int32)
    x = tl.where(sc == 255, nan_f32(sc.shape), pow2(tl.minimum(sc, 254) - 127))
    val = tile_decode(c, INT8, E, M, BIAS, NAN_MAG, IEEE) * x[:, None]
    mask = (j[None, :] < GROUP_SIZE) & (col < cols)
    tl.store(out_ptr + row * out_stride + col, narrow(val, out_ptr.dtype.element_ty), mask=mask)


@jit
def _row_absmax_kernel(
    x_ptr,  # *fp32 / *bf16 / *fp16 [rows, cols], rows x_stride apart
    part_ptr,  # *fp32 [rows, tiles_per_row], output: each tile's absmax of finite values
    cols,
    groups,
    x_stride,
    tiles_per_row,
    GROUP_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_GS: tl.constexpr,
):
    """nvfp4's first pass: per tile, the absmax of the finite values (the row's max of these
    partials is exact in any order, so the host reduces them with ``amax``)."""
    row, g, j, col = tile_coords(tiles_per_row, GROUP_SIZE, BLOCK_G, BLOCK_GS)
    in_block = (j[None, :] < GROUP_SIZE) & (g[:, None] < groups)
    v = widen(tl.load(x_ptr + row * x_stride + col, mask=in_block & (col < cols), other=0.0))
    absmax, _ = tile_absmax(v)
    tl.store(part_ptr + tl.program_id(0), tl.max(absmax, axis=0))


@jit
def _nvfp4_quantize_kernel(
    x_ptr,  # *fp32 / *bf16 / *fp16 [rows, cols], rows x_stride apart
    row_absmax_ptr,  # *fp32 [rows]: absmax of each row's finite values (``_row_absmax_kernel``)
    codes_ptr,  # *uint8 [rows, groups * 8], output (E2M1, two per byte)
    scales_ptr,  # *uint8 [rows, groups] E4M3 block scales, output
    tensor_ptr,  # *fp32 [rows] tensor scales, output
    cols,
    groups,
    x_stride,
    codes_stride,
    scales_stride,
    tensor_stride,
    tiles_per_row,
    seed,
    GROUP_SIZE: tl.constexpr,  # 16
    STOCHASTIC: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_GS: tl.constexpr,
):
    """Row scale ``t = absmax(row) / 2688``; block scale ``b = e4m3_rne(absmax(block) / 6 / t)``
    (0x7F for a block with NaN or Inf); elements ``x / (decode(b) * t)`` in E2M1 (zero codes where
    that scale is 0)."""
    row, g, _, col = tile_coords(tiles_per_row, GROUP_SIZE, BLOCK_G, BLOCK_GS)
    in_block = g[:, None] < groups
    v = widen(tl.load(x_ptr + row * x_stride + col, mask=in_block & (col < cols), other=0.0))
    ra = tl.load(row_absmax_ptr + row)
    t = tl.math.div_rn(ra, 2688.0)
    absmax, finite = tile_absmax(v)
    tb = tl.full(absmax.shape, 1.0, tl.float32) * tl.where(t > 0.0, t, 1.0)
    bf = tl.math.div_rn(tl.math.div_rn(absmax, tl.full(absmax.shape, 6.0, tl.float32)), tb)
    bf = tl.where(t > 0.0, bf, 0.0)
    b = encode_float(bf, bf, 4, 3, 7, 0x7E, 448.0, 0x7F, False)
    scale = decode_float(b, 4, 3, 7, 0x7F, False) * t
    safe = tl.where(scale > 0.0, scale, 1.0)
    q = tl.math.div_rn(v, tl.broadcast_to(safe[:, None], v.shape))
    offs = row * groups * GROUP_SIZE + col
    c = tile_encode(q, offs, seed, False, 2, 1, 1, 7, 6.0, -1, STOCHASTIC)
    c = tl.where((finite & (scale > 0.0))[:, None], c, 0)
    b = tl.where(finite, b, 0x7F)
    tl.store(scales_ptr + row * scales_stride + g, b.to(tl.uint8), mask=g < groups)
    store_codes(codes_ptr + row * codes_stride, c, g, groups, GROUP_SIZE, 4, BLOCK_G, BLOCK_GS)
    tl.store(tensor_ptr + row * tensor_stride, t, mask=(tl.program_id(0) % tiles_per_row) == 0)


@jit
def _nvfp4_dequantize_kernel(
    codes_ptr,  # *uint8 [rows, groups * 8]
    scales_ptr,  # *uint8 [rows, groups] E4M3
    tensor_ptr,  # *fp32 [rows]
    out_ptr,  # *fp32 / *bf16 / *fp16 [rows, cols]
    cols,
    groups,
    codes_stride,
    scales_stride,
    tensor_stride,
    out_stride,
    tiles_per_row,
    GROUP_SIZE: tl.constexpr,  # 16
    BLOCK_G: tl.constexpr,
    BLOCK_GS: tl.constexpr,
):
    row, g, _, col = tile_coords(tiles_per_row, GROUP_SIZE, BLOCK_G, BLOCK_GS)
    c = load_codes(codes_ptr + row * codes_stride, g, groups, GROUP_SIZE, 4, BLOCK_G, BLOCK_GS)
    b = tl.load(scales_ptr + row * scales_stride + g, mask=g < groups, other=0).to(tl.int32)
    t = tl.load(tensor_ptr + row * tensor_stride)
    scale = decode_float(b, 4, 3, 7, 0x7F, False) * t
    val = decode_float(c, 2, 1, 1, -1, False) * scale[:, None]
    mask = col < cols
    tl.store(out_ptr + row * out_stride + col, narrow(val, out_ptr.dtype.element_ty), mask=mask)
