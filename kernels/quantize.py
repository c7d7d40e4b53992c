"""Block-wise symmetric quantize / dequantize (qwZ weights, qgZ gradient chunks).

CUDA tensors take the Triton kernels; CPU tensors take ``cpu.py``, the torch reference's arithmetic
done tile by tile in cache (bit-identical to ``reference.py``, several times faster).
``impl="torch"`` forces the CPU path, ``impl="triton"`` the kernels (tests do this on CPU under
``TRITON_INTERPRET=1``). The kernels match the reference bit for bit (same scales, same codes); see ``_triton.py`` for
the tile they share and why each arithmetic step is written the way it is.
"""

from __future__ import annotations

import functools

import torch

from ._triton import (
    LaunchPlan,
    TileConfig,
    check_launchable,
    jit,
    tile_load_codes,
    tile_coords,
    tile_quantize,
    tile_store_codes,
    tl,
    to_out_dtype,
)
from .cpu import dequantize_cpu, quantize_cpu
from .layout import (
    DEFAULT_WEIGHT_GROUP_SIZE,
    QuantizedTensor,
    check_bits,
    check_dims,
    check_float_dtype,
    check_group_size,
    check_quantized_out,
    check_seed,
    codes_dtype,
    num_groups,
    output_buffer,
    qmax,
    row_bytes,
    split_rows,
)


# ----------------------------------------------------------------------------------------------
# Kernels. One program = BLOCK_G consecutive blocks of one row (program id -> (row, tile)).
# ----------------------------------------------------------------------------------------------
@jit
def _quantize_kernel(
    x_ptr,  # *fp32 / *bf16 / *fp16, [rows, cols] contiguous input, read through its own dtype
    codes_ptr,  # *int8 [rows, row_bytes] (BITS 8) or *uint8 [rows, row_bytes] (BITS 4), output
    scales_ptr,  # *fp32 [rows, groups], output
    cols,  # elements per row (unpadded)
    groups,  # blocks per row = ceil(cols / GROUP_SIZE)
    row_bytes,  # code bytes per row = groups * GROUP_SIZE * BITS / 8
    tiles_per_row,  # ceil(groups / BLOCK_G)
    seed,  # Philox seed for stochastic rounding (unused otherwise)
    GROUP_SIZE: tl.constexpr,
    BITS: tl.constexpr,
    QMAX: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_GS: tl.constexpr,
):
    row, g, j, col = tile_coords(tiles_per_row, GROUP_SIZE, BLOCK_G, BLOCK_GS)
    in_block = (j[None, :] < GROUP_SIZE) & (g[:, None] < groups)
    v = tl.load(x_ptr + row * cols + col, mask=in_block & (col < cols), other=0.0).to(tl.float32)
    offs = row * groups * GROUP_SIZE + col  # [BG, BGS] int64 index into [rows, groups*GROUP_SIZE]
    c, scale = tile_quantize(v, offs, seed, QMAX, STOCHASTIC)
    tl.store(scales_ptr + row * groups + g, scale, mask=g < groups)
    tile_store_codes(codes_ptr + row * row_bytes, c, g, groups, GROUP_SIZE, BITS, BLOCK_G, BLOCK_GS)


@jit
def _dequantize_kernel(
    codes_ptr,  # *int8 / *uint8 [rows, row_bytes], input codes
    scales_ptr,  # *fp32 [rows, groups], input scales
    out_ptr,  # *fp32 / *bf16 / *fp16 [rows, cols] contiguous output; its dtype is the result's
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
    c = tile_load_codes(codes_ptr + row * row_bytes, g, groups, GROUP_SIZE, BITS, BLOCK_G, BLOCK_GS)
    s = tl.load(scales_ptr + row * groups + g, mask=g < groups, other=0.0)  # [BG]
    val = c * s[:, None]  # [BG, BGS] fp32, exactly the reference's code * scale
    mask = (j[None, :] < GROUP_SIZE) & (col < cols)
    tl.store(out_ptr + row * cols + col, to_out_dtype(val, out_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Launchers. Everything that depends only on (shape, dtype, bits, group size) - the checks of
# those, the layout, the tile, the grid, the compile options - is worked out once per key in a
# cached plan; a call then checks only what can differ between calls with the same key (seed,
# contiguity, the caller's buffers) and launches.
# ----------------------------------------------------------------------------------------------
PLAN_CACHE_SIZE = 4096
"""Launch plans kept per launcher (one per distinct shape/dtype/bits/group size in use)."""


class QuantizePlan:
    """Layout and launch of ``quantize`` for one (numel, rows, dtype, bits, group size, rounding)."""

    def __init__(self, numel: int, rows: int, dtype: torch.dtype, bits: int, group_size: int, stochastic: bool):
        check_bits(bits)  # the checks of check_quantize_args that depend on the key only
        check_group_size(group_size, bits)
        check_float_dtype(dtype, "input")
        self.cols = split_rows(numel, rows)
        self.rows, self.bits, self.group_size = rows, bits, group_size
        self.groups = num_groups(self.cols, group_size)
        self.row_bytes = row_bytes(self.cols, bits, group_size)
        self.codes_dtype = codes_dtype(bits)
        self.launch = None  # nothing to launch for an empty tensor
        if rows * self.groups:
            cfg = TileConfig(group_size, self.groups, rows)
            self.launch = LaunchPlan(
                _quantize_kernel, cfg, (self.cols, self.groups, self.row_bytes, cfg.tiles_per_row),
                dict(GROUP_SIZE=group_size, BITS=bits, QMAX=qmax(bits), STOCHASTIC=stochastic),
            )


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def quantize_plan(numel: int, rows: int, dtype: torch.dtype, bits: int, group_size: int, stochastic: bool) -> QuantizePlan:
    return QuantizePlan(numel, rows, dtype, bits, group_size, stochastic)


class DequantizePlan:
    """Launch of ``dequantize`` for one (rows, cols, bits, group size, output dtype)."""

    def __init__(self, rows: int, cols: int, bits: int, group_size: int, out_dtype: torch.dtype):
        check_float_dtype(out_dtype, "out")
        groups = num_groups(cols, group_size)
        self.launch = None
        if rows * groups:
            cfg = TileConfig(group_size, groups, rows)
            self.launch = LaunchPlan(
                _dequantize_kernel, cfg, (cols, groups, row_bytes(cols, bits, group_size), cfg.tiles_per_row),
                dict(GROUP_SIZE=group_size, BITS=bits),
            )


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def dequantize_plan(rows: int, cols: int, bits: int, group_size: int, out_dtype: torch.dtype) -> DequantizePlan:
    return DequantizePlan(rows, cols, bits, group_size, out_dtype)


def _quantize_triton(
    x: torch.Tensor, bits: int, group_size: int, *, rows: int = 1, stochastic: bool = False, seed: int = 0,
    out: QuantizedTensor | None = None,
) -> QuantizedTensor:
    """Triton twin of ``quantize_ref`` (same checks, same result bit for bit), into ``out`` if given."""
    plan = quantize_plan(x.numel(), rows, x.dtype, bits, group_size, bool(stochastic))
    seed = check_seed(seed)
    if not x.is_cuda:
        check_launchable(x)
    if not x.is_contiguous():
        x = x.contiguous()  # the kernel reads x as a flat [rows, cols] buffer
    if out is None:
        codes = torch.empty(rows, plan.row_bytes, dtype=plan.codes_dtype, device=x.device)  # [rows, row_bytes]
        scales = torch.empty(rows, plan.groups, dtype=torch.float32, device=x.device)  # [rows, groups]
        out = QuantizedTensor.unchecked(codes, scales, plan.cols, bits, group_size)
    else:
        check_quantized_out(out, rows, plan.cols, bits, group_size, x.device)
    if plan.launch is not None:
        plan.launch((x, out.codes, out.scales), (seed if stochastic else 0,))
    return out


def _dequantize_triton(
    q: QuantizedTensor, *, out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Triton twin of ``dequantize_ref``: writes straight into ``out`` when one is given."""
    _, rows = check_dims(q, False, "dequantize")
    codes = q.codes
    if not codes.is_cuda:
        check_launchable(codes)
    out = output_buffer(out, rows, q.cols, dtype, codes.device)  # [rows, cols] or the caller's buffer
    plan = dequantize_plan(rows, q.cols, q.bits, q.group_size, out.dtype)
    if plan.launch is not None:
        plan.launch((codes.contiguous(), q.scales.contiguous(), out))
    return out


# ----------------------------------------------------------------------------------------------
# Public, dispatching functions (signatures fixed by docs/design.md).
# ----------------------------------------------------------------------------------------------
def _use_triton(t: torch.Tensor, impl: str | None) -> bool:
    if impl is None:
        return t.is_cuda
    if impl not in ("triton", "torch"):
        raise ValueError(f"impl must be None (auto), 'triton' or 'torch', got {impl!r}")
    return impl == "triton"


def copy_into(q: QuantizedTensor, out: QuantizedTensor | None) -> QuantizedTensor:
    """``q`` itself, or copied into the caller's ``out`` (for paths that cannot write in place)."""
    if out is None:
        return q
    check_quantized_out(out, q.rows, q.cols, q.bits, q.group_size, q.codes.device)
    out.codes.copy_(q.codes)
    out.scales.copy_(q.scales)
    return out


def quantize(
    x: torch.Tensor,
    bits: int = 8,
    group_size: int | None = None,
    *,
    rows: int = 1,
    stochastic: bool = False,
    seed: int = 0,
    impl: str | None = None,
    out: QuantizedTensor | None = None,
) -> QuantizedTensor:
    """Quantize ``x`` (fp32/bf16/fp16, any shape, numel divisible by ``rows``) as ``rows`` rows.

    ``stochastic=True`` rounds up with probability equal to the fractional part (an unbiased
    quantizer, as QSDP needs); ``seed`` makes it reproducible. ``out``: a QuantizedTensor of the
    same layout (``[rows, *]`` codes and scales, contiguous, on ``x``'s device; for example views
    into a collective's send buffer) that receives the result and is returned; the Triton
    kernels write it in place.
    """
    group_size = DEFAULT_WEIGHT_GROUP_SIZE if group_size is None else group_size
    if _use_triton(x, impl):
        return _quantize_triton(x, bits, group_size, rows=rows, stochastic=stochastic, seed=seed, out=out)
    return copy_into(quantize_cpu(x, bits, group_size, rows=rows, stochastic=stochastic, seed=seed), out)


def dequantize(
    q: QuantizedTensor,
    *,
    out: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    impl: str | None = None,
) -> torch.Tensor:
    """QuantizedTensor -> ``[rows, cols]`` in ``dtype``, or written into ``out`` (contiguous,
    ``rows*cols`` elements, its dtype wins)."""
    if _use_triton(q.codes, impl):
        return _dequantize_triton(q, out=out, dtype=dtype)
    return dequantize_cpu(q, out=out, dtype=dtype)
