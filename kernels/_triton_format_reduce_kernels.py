"""Triton kernels of the float formats' reductions over received wire rows (qgZ's reduce side):
``k`` sources' rows ``uint8 [k, rows, B]``, read in place, summed per tile in fp32 (in source
order from +0.0, the codecs' generic path) and stored (``_format_dequantize_sum_kernel``) or
quantized again straight into new wire rows (``_fp8_sum_requantize_kernel``,
``_mx_sum_requantize_kernel``: the quantize kernels' encoders on the summed tile). Launched by
``triton_format_reduce.py``; the tile and exactness rules are ``_triton_format_kernels.py``'s.

A wire row (``format_layout``): packed codes (``cb`` bytes), then the block scales (fp8: an fp32
per group at any byte offset, read as four bytes since a GPU load of an fp32 must be aligned;
mx: E8M0 bytes; nvfp4: E4M3 bytes), then nvfp4's fp32 tensor scale.
"""

from __future__ import annotations

from ._triton import jit, tile_coords, tl
from ._triton_elems import decode_float, load_codes, nan_f32, narrow, pow2, tile_decode
from ._triton_format_kernels import fp8_encode_tile, mx_encode_tile


@jit
def load_f32(ptr, mask):
    """fp32 values stored little-endian at byte pointers ``ptr`` (any alignment)."""
    b0 = tl.load(ptr, mask=mask, other=0).to(tl.uint32)
    b1 = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint32)
    b2 = tl.load(ptr + 2, mask=mask, other=0).to(tl.uint32)
    b3 = tl.load(ptr + 3, mask=mask, other=0).to(tl.uint32)
    return (b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)).to(tl.float32, bitcast=True)


@jit
def wire_tile_sum(
    wire_ptr,  # *uint8 [k, rows, B]
    k,
    k_stride,
    row_stride,
    cb,  # code bytes per row: where the scales start
    row,
    g,
    j,
    col,
    cols,
    groups,
    SCHEME: tl.constexpr,  # 0 fp8, 1 mx, 2 nvfp4
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
    """The tile's sum over the k sources' rows ``row``: each decoded as the dequantize kernels do
    (``code_value * block_scale``) and added in fp32 in order 0..k-1 to +0.0. Lanes outside the
    row's blocks or past its end are 0 (what a quantizer reads there)."""
    gm = g < groups
    acc = tl.zeros((BLOCK_G, BLOCK_GS), tl.float32)
    for s in range(k):
        base = wire_ptr + row * row_stride + (s + row * 0) * k_stride  # int64 (row is): s * k_stride may pass 2**31
        c = load_codes(base, g, groups, GROUP_SIZE, BITS, BLOCK_G, BLOCK_GS)
        if SCHEME == 0:
            sc = load_f32(base + cb + 4 * g, gm)
            val = tile_decode(c, False, E, M, BIAS, NAN_MAG, IEEE) * sc[:, None]
        elif SCHEME == 1:
            e8 = tl.load(base + cb + g, mask=gm, other=0).to(tl.int32)
            sc = tl.where(e8 == 255, nan_f32(e8.shape), pow2(tl.minimum(e8, 254) - 127))
            val = tile_decode(c, INT8, E, M, BIAS, NAN_MAG, IEEE) * sc[:, None]
        else:
            b = tl.load(base + cb + g, mask=gm, other=0).to(tl.int32)
            t = load_f32(base + cb + groups + tl.zeros_like(g), gm)
            sc = decode_float(b, 4, 3, 7, 0x7F, False) * t
            val = decode_float(c, 2, 1, 1, -1, False) * sc[:, None]
        acc = acc + val
    inside = (j[None, :] < GROUP_SIZE) & gm[:, None] & (col < cols)
    return tl.where(inside, acc, 0.0)


@jit
def _format_dequantize_sum_kernel(
    wire_ptr,  # *uint8 [k, rows, B]
    out_ptr,  # *fp32 / *bf16 / *fp16 [rows, cols], rows out_stride apart
    k,
    cols,
    groups,
    k_stride,
    row_stride,
    cb,
    out_stride,
    tiles_per_row,
    SCHEME: tl.constexpr,
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
    acc = wire_tile_sum(
        wire_ptr,
        k,
        k_stride,
        row_stride,
        cb,
        row,
        g,
        j,
        col,
        cols,
        groups,
        SCHEME,
        GROUP_SIZE,
        BITS,
        INT8,
        E,
        M,
        BIAS,
        NAN_MAG,
        IEEE,
        BLOCK_G,
        BLOCK_GS,
    )
    mask = (j[None, :] < GROUP_SIZE) & (col < cols)
    tl.store(out_ptr + row * out_stride + col, narrow(acc, out_ptr.dtype.element_ty), mask=mask)


@jit
def _fp8_sum_requantize_kernel(
    wire_ptr,  # *uint8 [k, rows, B]: received rows
    codes_ptr,  # *uint8 [rows, *]: the new rows' codes (rows codes_stride apart), output
    scales_ptr,  # *fp32 [rows, groups], output
    k,
    cols,
    groups,
    k_stride,
    row_stride,
    cb,
    codes_stride,
    scales_stride,
    tiles_per_row,
    seed,
    GROUP_SIZE: tl.constexpr,
    E_IN: tl.constexpr,
    M_IN: tl.constexpr,
    BIAS_IN: tl.constexpr,
    NAN_MAG_IN: tl.constexpr,
    IEEE_IN: tl.constexpr,
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
    """The summed tile quantized as ``_fp8_quantize_kernel`` quantizes an input tile."""
    row, g, j, col = tile_coords(tiles_per_row, GROUP_SIZE, BLOCK_G, BLOCK_GS)
    v = wire_tile_sum(
        wire_ptr,
        k,
        k_stride,
        row_stride,
        cb,
        row,
        g,
        j,
        col,
        cols,
        groups,
        0,
        GROUP_SIZE,
        8,
        False,
        E_IN,
        M_IN,
        BIAS_IN,
        NAN_MAG_IN,
        IEEE_IN,
        BLOCK_G,
        BLOCK_GS,
    )
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
def _mx_sum_requantize_kernel(
    wire_ptr,  # *uint8 [k, rows, B]: received rows
    codes_ptr,  # *uint8 [rows, *]: the new rows' codes, output
    scales_ptr,  # *uint8 [rows, groups] E8M0, output
    k,
    cols,
    groups,
    k_stride,
    row_stride,
    cb,
    codes_stride,
    scales_stride,
    tiles_per_row,
    seed,
    GROUP_SIZE: tl.constexpr,
    BITS_IN: tl.constexpr,
    INT8_IN: tl.constexpr,
    E_IN: tl.constexpr,
    M_IN: tl.constexpr,
    BIAS_IN: tl.constexpr,
    NAN_MAG_IN: tl.constexpr,
    IEEE_IN: tl.constexpr,
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
    """The summed tile quantized as ``_mx_quantize_kernel`` quantizes an input tile."""
    row, g, j, col = tile_coords(tiles_per_row, GROUP_SIZE, BLOCK_G, BLOCK_GS)
    v = wire_tile_sum(
        wire_ptr,
        k,
        k_stride,
        row_stride,
        cb,
        row,
        g,
        j,
        col,
        cols,
        groups,
        1,
        GROUP_SIZE,
        BITS_IN,
        INT8_IN,
        E_IN,
        M_IN,
        BIAS_IN,
        NAN_MAG_IN,
        IEEE_IN,
        BLOCK_G,
        BLOCK_GS,
    )
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
