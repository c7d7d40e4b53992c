"""Reductions over k stacked quantized tensors: dequantize-sum (the last qgZ hop) and the fused
dequantize-sum-requantize of the qgZ intra-node hop (no k full-precision copies materialised).

Both kernels walk the k inputs of one tile in index order 0..k-1, accumulating ``code * scale``
into an fp32 register tile that starts at zero: the reference's ``acc = acc + deq[i]`` exactly.
The fused kernel then quantizes that tile in place, so the only memory traffic is k code/scale
reads and one code/scale write; the full-precision sum never leaves registers.
"""

from __future__ import annotations

import torch

from ._triton import (
    TileConfig,
    check_launchable,
    jit,
    on_device,
    tile_load_codes,
    tile_coords,
    tile_quantize,
    tile_store_codes,
    tl,
    to_out_dtype,
)
from .layout import (
    QuantizedTensor,
    check_dims,
    check_requantize_args,
    codes_dtype,
    num_groups,
    output_buffer,
    qmax,
    row_bytes,
)
from .cpu import dequantize_sum_cpu, dequantize_sum_requantize_cpu
from .quantize import _use_triton


@jit
def _tile_sum(
    codes_ptr,  # *int8 / *uint8 [k, rows, row_bytes] stacked input codes
    scales_ptr,  # *fp32 [k, rows, groups] stacked input scales
    k,  # number of stacked inputs
    rows,  # rows per input
    row,  # int64 row of this program
    g,  # [BG] int64 block indices of this tile
    groups,  # blocks per row
    row_bytes,  # code bytes per row of the inputs
    GROUP_SIZE: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_GS: tl.constexpr,
):
    """Sum over i = 0..k-1 of dequantized input i on this tile -> [BG, BGS] fp32 (padded lanes
    of a block hold its padding codes' value, 0, or NaN for a non-finite block)."""
    acc = tl.zeros((BLOCK_G, BLOCK_GS), dtype=tl.float32)
    for i in range(k):
        r = i * rows + row  # int64 row in the flattened [k * rows, ...] stack
        c = tile_load_codes(codes_ptr + r * row_bytes, g, groups, GROUP_SIZE, BITS, BLOCK_G, BLOCK_GS)
        s = tl.load(scales_ptr + r * groups + g, mask=g < groups, other=0.0)  # [BG]
        acc = acc + c * s[:, None]
    return acc


@jit
def _dequantize_sum_kernel(
    codes_ptr,  # *int8 / *uint8 [k, rows, row_bytes] stacked input codes
    scales_ptr,  # *fp32 [k, rows, groups] stacked input scales
    out_ptr,  # *fp32 / *bf16 / *fp16 [rows, cols] contiguous output
    k,  # number of stacked inputs
    rows,  # rows per input
    cols,  # elements per row (unpadded)
    groups,  # blocks per row
    row_bytes,  # code bytes per row
    tiles_per_row,  # ceil(groups / BLOCK_G)
    GROUP_SIZE: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_GS: tl.constexpr,
):
    row, g, j, col = tile_coords(tiles_per_row, GROUP_SIZE, BLOCK_G, BLOCK_GS)
    acc = _tile_sum(codes_ptr, scales_ptr, k, rows, row, g, groups, row_bytes, GROUP_SIZE, BITS, BLOCK_G, BLOCK_GS)
    mask = (j[None, :] < GROUP_SIZE) & (col < cols)
    tl.store(out_ptr + row * cols + col, to_out_dtype(acc, out_ptr.dtype.element_ty), mask=mask)


@jit
def _dequantize_sum_requantize_kernel(
    codes_ptr,  # *int8 / *uint8 [k, rows, in_row_bytes] stacked input codes
    scales_ptr,  # *fp32 [k, rows, groups] stacked input scales
    out_codes_ptr,  # *int8 / *uint8 [rows, out_row_bytes] output codes (OUT_BITS)
    out_scales_ptr,  # *fp32 [rows, groups] output scales
    k,  # number of stacked inputs
    rows,  # rows per input
    groups,  # blocks per row (same layout in and out)
    in_row_bytes,  # input code bytes per row
    out_row_bytes,  # output code bytes per row
    tiles_per_row,  # ceil(groups / BLOCK_G)
    seed,  # Philox seed for stochastic rounding
    GROUP_SIZE: tl.constexpr,
    IN_BITS: tl.constexpr,
    OUT_BITS: tl.constexpr,
    QMAX: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_GS: tl.constexpr,
):
    row, g, j, col = tile_coords(tiles_per_row, GROUP_SIZE, BLOCK_G, BLOCK_GS)
    acc = _tile_sum(  # [BG, BGS] fp32, never written to memory
        codes_ptr, scales_ptr, k, rows, row, g, groups, in_row_bytes, GROUP_SIZE, IN_BITS, BLOCK_G, BLOCK_GS
    )
    offs = row * groups * GROUP_SIZE + col  # [BG, BGS] int64 index into [rows, groups*GROUP_SIZE]
    c, scale = tile_quantize(acc, offs, seed, QMAX, STOCHASTIC)
    tl.store(out_scales_ptr + row * groups + g, scale, mask=g < groups)
    tile_store_codes(out_codes_ptr + row * out_row_bytes, c, g, groups, GROUP_SIZE, OUT_BITS, BLOCK_G, BLOCK_GS)


def _dequantize_sum_triton(
    q: QuantizedTensor, *, out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Triton twin of ``dequantize_sum_ref``."""
    k, rows = check_dims(q, True, "dequantize_sum")
    check_launchable(q.codes)
    cols = q.cols
    out = output_buffer(out, rows, cols, dtype, q.codes.device)  # [rows, cols] or the caller's buffer
    g = num_groups(cols, q.group_size)
    if k == 0:
        return out.zero_()
    if rows * g:
        cfg = TileConfig(q.group_size, g)
        with on_device(out):
            _dequantize_sum_kernel[(rows * cfg.tiles_per_row,)](
                q.codes.contiguous(), q.scales.contiguous(), out, k, rows, cols, g, q.codes.shape[-1],
                cfg.tiles_per_row, GROUP_SIZE=q.group_size, BITS=q.bits, **cfg.meta(),
            )
    return out


def _dequantize_sum_requantize_triton(
    q: QuantizedTensor, bits: int, group_size: int, *, stochastic: bool = False, seed: int = 0
) -> QuantizedTensor:
    """Triton twin of ``dequantize_sum_requantize_ref``: one pass, sum kept in registers."""
    k, rows, seed = check_requantize_args(q, bits, group_size, seed)
    check_launchable(q.codes)
    cols, device = q.cols, q.codes.device
    g = num_groups(cols, group_size)
    out_rb = row_bytes(cols, bits, group_size)
    codes = torch.empty(rows, out_rb, dtype=codes_dtype(bits), device=device)  # [rows, out_row_bytes]
    scales = torch.empty(rows, g, dtype=torch.float32, device=device)  # [rows, groups]
    if rows * g:
        cfg = TileConfig(group_size, g)
        with on_device(codes):
            _dequantize_sum_requantize_kernel[(rows * cfg.tiles_per_row,)](
                q.codes.contiguous(), q.scales.contiguous(), codes, scales, k, rows, g, q.codes.shape[-1], out_rb,
                cfg.tiles_per_row, seed, GROUP_SIZE=group_size, IN_BITS=q.bits, OUT_BITS=bits, QMAX=qmax(bits),
                STOCHASTIC=bool(stochastic), **cfg.meta(),
            )
    return QuantizedTensor(codes, scales, cols, bits, group_size)


def dequantize_sum(
    q: QuantizedTensor,
    *,
    out: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    impl: str | None = None,
) -> torch.Tensor:
    """Stacked ``[k, rows, *]`` -> fp32-accumulated sum over k as ``[rows, cols]`` (or into ``out``)."""
    if _use_triton(q.codes, impl):
        return _dequantize_sum_triton(q, out=out, dtype=dtype)
    return dequantize_sum_cpu(q, out=out, dtype=dtype)


def dequantize_sum_requantize(
    q: QuantizedTensor,
    bits: int,
    group_size: int | None = None,
    *,
    stochastic: bool = False,
    seed: int = 0,
    impl: str | None = None,
) -> QuantizedTensor:
    """Stacked ``[k, rows, *]`` -> their sum re-quantized to ``bits`` (same group size)."""
    group_size = q.group_size if group_size is None else group_size
    if _use_triton(q.codes, impl):
        return _dequantize_sum_requantize_triton(q, bits, group_size, stochastic=stochastic, seed=seed)
    return dequantize_sum_requantize_cpu(q, bits, group_size, stochastic=stochastic, seed=seed)
