"""Reductions over k stacked quantized tensors: dequantize-sum (the last qgZ hop) and the fused
dequantize-sum-requantize of the qgZ intra-node hop (no k full-precision copies materialised).

Both kernels walk the k inputs of one tile in index order 0..k-1, accumulating ``code * scale``
into an fp32 register tile that starts at zero: the reference's ``acc = acc + deq[i]`` exactly.
The fused kernel then quantizes that tile in place, so the only memory traffic is k code/scale
reads and one code/scale write; the full-precision sum never leaves registers.
"""

from __future__ import annotations

import functools

import torch

from ._triton import (
    LaunchPlan,
    TileConfig,
    check_launchable,
    jit,
    tile_coords,
    tile_load_codes,
    tile_quantize,
    tile_store_codes,
    tl,
    to_out_dtype,
)
from .cpu import dequantize_sum_cpu, dequantize_sum_requantize_cpu
from .layout import (
    QuantizedTensor,
    check_dims,
    check_float_dtype,
    check_quantized_out,
    check_requantize_args,
    codes_dtype,
    num_groups,
    output_rows,
    qmax,
    row_bytes,
    row_stride,
)
from .quantize import PLAN_CACHE_SIZE, _use_triton, quantized_rows


@jit
def _tile_sum(
    codes_ptr,  # *int8 / *uint8 [k, rows, row_bytes] stacked input codes
    scales_ptr,  # *fp32 [k, rows, groups] stacked input scales
    k,  # number of stacked inputs
    rows,  # rows per input
    row,  # int64 row of this program
    g,  # [BG] int64 block indices of this tile
    groups,  # blocks per row
    codes_stride,  # elements between code rows of the flattened [k * rows] stack (row_bytes if contiguous)
    scales_stride,  # elements between scale rows (groups if contiguous)
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
        c = tile_load_codes(codes_ptr + r * codes_stride, g, groups, GROUP_SIZE, BITS, BLOCK_G, BLOCK_GS)
        s = tl.load(scales_ptr + r * scales_stride + g, mask=g < groups, other=0.0)  # [BG]
        acc = acc + c * s[:, None]
    return acc


@jit
def _dequantize_sum_kernel(
    codes_ptr,  # *int8 / *uint8 [k, rows, row_bytes] stacked input codes
    scales_ptr,  # *fp32 [k, rows, groups] stacked input scales
    out_ptr,  # *fp32 / *bf16 / *fp16 [rows, cols] output rows (unit inner stride)
    k,  # number of stacked inputs
    rows,  # rows per input
    cols,  # elements per row (unpadded)
    groups,  # blocks per row
    codes_stride,  # elements between code rows (row_bytes if contiguous)
    scales_stride,  # elements between scale rows (groups if contiguous)
    out_stride,  # elements between output rows (cols if contiguous)
    tiles_per_row,  # ceil(groups / BLOCK_G)
    GROUP_SIZE: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_GS: tl.constexpr,
):
    row, g, j, col = tile_coords(tiles_per_row, GROUP_SIZE, BLOCK_G, BLOCK_GS)
    acc = _tile_sum(
        codes_ptr, scales_ptr, k, rows, row, g, groups, codes_stride, scales_stride, GROUP_SIZE, BITS, BLOCK_G, BLOCK_GS
    )
    mask = (j[None, :] < GROUP_SIZE) & (col < cols)
    tl.store(out_ptr + row * out_stride + col, to_out_dtype(acc, out_ptr.dtype.element_ty), mask=mask)


@jit
def _dequantize_sum_requantize_kernel(
    codes_ptr,  # *int8 / *uint8 [k, rows, in_row_bytes] stacked input codes
    scales_ptr,  # *fp32 [k, rows, groups] stacked input scales
    out_codes_ptr,  # *int8 / *uint8 [rows, out_row_bytes] output codes (OUT_BITS)
    out_scales_ptr,  # *fp32 [rows, groups] output scales
    k,  # number of stacked inputs
    rows,  # rows per input
    groups,  # blocks per row (same layout in and out)
    codes_stride,  # elements between input code rows (in_row_bytes if contiguous)
    scales_stride,  # elements between input scale rows (groups if contiguous)
    out_codes_stride,  # elements between output code rows (out_row_bytes if contiguous; a wire row in place)
    out_scales_stride,  # elements between output scale rows (groups if contiguous)
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
    row, g, _j, col = tile_coords(tiles_per_row, GROUP_SIZE, BLOCK_G, BLOCK_GS)
    acc = _tile_sum(  # [BG, BGS] fp32, never written to memory
        codes_ptr,
        scales_ptr,
        k,
        rows,
        row,
        g,
        groups,
        codes_stride,
        scales_stride,
        GROUP_SIZE,
        IN_BITS,
        BLOCK_G,
        BLOCK_GS,
    )
    offs = row * groups * GROUP_SIZE + col  # [BG, BGS] int64 index into [rows, groups*GROUP_SIZE]
    c, scale = tile_quantize(acc, offs, seed, QMAX, STOCHASTIC)
    tl.store(out_scales_ptr + row * out_scales_stride + g, scale, mask=g < groups)
    tile_store_codes(out_codes_ptr + row * out_codes_stride, c, g, groups, GROUP_SIZE, OUT_BITS, BLOCK_G, BLOCK_GS)


class DequantizeSumPlan:
    """Launch of ``dequantize_sum`` for one (k, rows, cols, bits, group size, output dtype,
    strides); ``strides`` = ``(codes_stride, scales_stride, out_stride)``, None if contiguous."""

    def __init__(
        self,
        k: int,
        rows: int,
        cols: int,
        bits: int,
        group_size: int,
        out_dtype: torch.dtype,
        strides: tuple[int, int, int] | None = None,
    ):
        check_float_dtype(out_dtype, "out")
        groups = num_groups(cols, group_size)
        if strides is None:
            strides = (row_bytes(cols, bits, group_size), groups, cols)
        self.launch = None  # k = 0 (a sum of nothing) or an empty tensor: no kernel
        if k and rows * groups:
            cfg = TileConfig(group_size, groups, rows)
            self.launch = LaunchPlan(
                _dequantize_sum_kernel,
                cfg,
                (k, rows, cols, groups, *strides, cfg.tiles_per_row),
                dict(GROUP_SIZE=group_size, BITS=bits),
            )


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def dequantize_sum_plan(
    k: int,
    rows: int,
    cols: int,
    bits: int,
    group_size: int,
    out_dtype: torch.dtype,
    strides: tuple[int, int, int] | None = None,
):
    return DequantizeSumPlan(k, rows, cols, bits, group_size, out_dtype, strides)


class RequantizePlan:
    """Layout and launch of ``dequantize_sum_requantize`` for one (k, rows, cols, input bits,
    output bits, group size, rounding, strides); ``strides`` = ``(codes_stride, scales_stride,
    out_codes_stride, out_scales_stride)``, None if all are contiguous."""

    def __init__(
        self,
        k: int,
        rows: int,
        cols: int,
        in_bits: int,
        bits: int,
        group_size: int,
        stochastic: bool,
        strides: tuple[int, int, int, int] | None = None,
    ):
        self.groups = num_groups(cols, group_size)
        self.row_bytes = row_bytes(cols, bits, group_size)
        self.codes_dtype = codes_dtype(bits)
        if strides is None:
            strides = (row_bytes(cols, in_bits, group_size), self.groups, self.row_bytes, self.groups)
        self.launch = None
        if rows * self.groups:
            cfg = TileConfig(group_size, self.groups, rows)
            self.launch = LaunchPlan(
                _dequantize_sum_requantize_kernel,
                cfg,
                (k, rows, self.groups, *strides, cfg.tiles_per_row),
                dict(GROUP_SIZE=group_size, IN_BITS=in_bits, OUT_BITS=bits, QMAX=qmax(bits), STOCHASTIC=stochastic),
            )


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def requantize_plan(
    k: int,
    rows: int,
    cols: int,
    in_bits: int,
    bits: int,
    group_size: int,
    stochastic: bool,
    strides: tuple[int, int, int, int] | None = None,
):
    return RequantizePlan(k, rows, cols, in_bits, bits, group_size, stochastic, strides)


def _dequantize_sum_triton(
    q: QuantizedTensor, *, out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Triton twin of ``dequantize_sum_ref``; reads row-strided stacks (a received wire buffer) in place."""
    k, rows = check_dims(q, True, "dequantize_sum")
    if not q.codes.is_cuda:
        check_launchable(q.codes)
    out, os_ = output_rows(out, rows, q.cols, dtype, q.codes.device)  # [rows, cols] or the caller's buffer
    if k == 0:
        return out.zero_()
    codes, scales, cs, ss = quantized_rows(q)
    plan = dequantize_sum_plan(k, rows, q.cols, q.bits, q.group_size, out.dtype, (cs, ss, os_))
    if plan.launch is not None:
        plan.launch((codes, scales, out))
    return out


def _dequantize_sum_requantize_triton(
    q: QuantizedTensor,
    bits: int,
    group_size: int,
    *,
    stochastic: bool = False,
    seed: int = 0,
    out: QuantizedTensor | None = None,
) -> QuantizedTensor:
    """Triton twin of ``dequantize_sum_requantize_ref``: one pass, sum kept in registers; reads
    and writes row-strided views (wire buffers) in place."""
    k, rows, seed = check_requantize_args(q, bits, group_size, seed)
    if not q.codes.is_cuda:
        check_launchable(q.codes)
    codes, scales, cs, ss = quantized_rows(q)
    if out is None:
        rb, g = row_bytes(q.cols, bits, group_size), num_groups(q.cols, group_size)
        out = QuantizedTensor.unchecked(
            torch.empty(rows, rb, dtype=codes_dtype(bits), device=codes.device),  # [rows, out_row_bytes]
            torch.empty(rows, g, dtype=torch.float32, device=codes.device),  # [rows, groups]
            q.cols,
            bits,
            group_size,
        )
    else:
        check_quantized_out(out, rows, q.cols, bits, group_size, codes.device)
    strides = (cs, ss, row_stride(out.codes), row_stride(out.scales))
    plan = requantize_plan(k, rows, q.cols, q.bits, bits, group_size, bool(stochastic), strides)
    if plan.launch is not None:
        plan.launch((codes, scales, out.codes, out.scales), (seed if stochastic else 0,))
    return out


def dequantize_sum(
    q: QuantizedTensor, *, out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32, impl: str | None = None
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
    out: QuantizedTensor | None = None,
) -> QuantizedTensor:
    """Stacked ``[k, rows, *]`` -> their sum re-quantized to ``bits`` (same group size), into
    ``out`` if given (same contract as ``quantize``'s ``out``)."""
    group_size = q.group_size if group_size is None else group_size
    if _use_triton(q.codes, impl):
        return _dequantize_sum_requantize_triton(q, bits, group_size, stochastic=stochastic, seed=seed, out=out)
    return dequantize_sum_requantize_cpu(q, bits, group_size, stochastic=stochastic, seed=seed, out=out)
