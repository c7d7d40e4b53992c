"""Block-wise symmetric quantize / dequantize (qwZ weights, qgZ gradient chunks).

CUDA tensors take the Triton kernels; CPU tensors take ``cpu.py``, the torch reference's arithmetic
done tile by tile in cache (bit-identical to ``reference.py``, several times faster).
``impl="torch"`` forces the CPU path, ``impl="triton"`` the kernels (tests do this on CPU under
``TRITON_INTERPRET=1``). The kernels match the reference bit for bit (same scales, same codes); see ``_triton.py`` for
the tile they share and why each arithmetic step is written the way it is.
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
from .cpu import dequantize_cpu, quantize_cpu
from .layout import (
    DEFAULT_WEIGHT_GROUP_SIZE,
    QuantizedTensor,
    check_dims,
    check_quantize_args,
    codes_dtype,
    num_groups,
    output_buffer,
    qmax,
    row_bytes,
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
# Launchers: validate, allocate, size the grid.
# ----------------------------------------------------------------------------------------------
def _quantize_triton(
    x: torch.Tensor, bits: int, group_size: int, *, rows: int = 1, stochastic: bool = False, seed: int = 0
) -> QuantizedTensor:
    """Triton twin of ``quantize_ref`` (same checks, same result bit for bit)."""
    cols, seed = check_quantize_args(x, bits, group_size, rows, seed)
    check_launchable(x)
    g = num_groups(cols, group_size)
    rb = row_bytes(cols, bits, group_size)
    x2 = x.contiguous().view(rows, cols)  # [rows, cols]; a copy only if x was strided
    codes = torch.empty(rows, rb, dtype=codes_dtype(bits), device=x.device)  # [rows, row_bytes]
    scales = torch.empty(rows, g, dtype=torch.float32, device=x.device)  # [rows, groups]
    if rows * g:
        cfg = TileConfig(group_size, g)
        with on_device(x):
            _quantize_kernel[(rows * cfg.tiles_per_row,)](
                x2, codes, scales, cols, g, rb, cfg.tiles_per_row, seed,
                GROUP_SIZE=group_size, BITS=bits, QMAX=qmax(bits), STOCHASTIC=bool(stochastic), **cfg.meta(),
            )
    return QuantizedTensor(codes, scales, cols, bits, group_size)


def _dequantize_triton(
    q: QuantizedTensor, *, out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Triton twin of ``dequantize_ref``: writes straight into ``out`` when one is given."""
    _, rows = check_dims(q, False, "dequantize")
    check_launchable(q.codes)
    cols = q.cols
    out = output_buffer(out, rows, cols, dtype, q.codes.device)  # [rows, cols] or the caller's buffer
    g = num_groups(cols, q.group_size)
    if rows * g:
        cfg = TileConfig(q.group_size, g)
        with on_device(out):
            _dequantize_kernel[(rows * cfg.tiles_per_row,)](
                q.codes.contiguous(), q.scales.contiguous(), out, cols, g, q.codes.shape[-1], cfg.tiles_per_row,
                GROUP_SIZE=q.group_size, BITS=q.bits, **cfg.meta(),
            )
    return out


# ----------------------------------------------------------------------------------------------
# Public, dispatching functions (signatures fixed by docs/design.md).
# ----------------------------------------------------------------------------------------------
def _use_triton(t: torch.Tensor, impl: str | None) -> bool:
    if impl not in (None, "triton", "torch"):
        raise ValueError(f"impl must be None (auto), 'triton' or 'torch', got {impl!r}")
    return impl == "triton" or (impl is None and t.is_cuda)


def quantize(
    x: torch.Tensor,
    bits: int = 8,
    group_size: int | None = None,
    *,
    rows: int = 1,
    stochastic: bool = False,
    seed: int = 0,
    impl: str | None = None,
) -> QuantizedTensor:
    """Quantize ``x`` (fp32/bf16/fp16, any shape, numel divisible by ``rows``) as ``rows`` rows.

    ``stochastic=True`` rounds up with probability equal to the fractional part (an unbiased
    quantizer, as QSDP needs); ``seed`` makes it reproducible.
    """
    group_size = DEFAULT_WEIGHT_GROUP_SIZE if group_size is None else group_size
    if _use_triton(x, impl):
        return _quantize_triton(x, bits, group_size, rows=rows, stochastic=stochastic, seed=seed)
    return quantize_cpu(x, bits, group_size, rows=rows, stochastic=stochastic, seed=seed)


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
