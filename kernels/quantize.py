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
    tile_coords,
    tile_load_codes,
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
    output_rows,
    qmax,
    row_bytes,
    row_geometry,
    row_stride,
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
    x_inner,  # input row r starts at (r // x_inner) * x_outer + (r % x_inner) * x_stride
    x_outer,  # (two levels, so a swizzled view [a, b, cols] of the input needs no copy)
    x_stride,
    codes_stride,  # elements between code rows (row_bytes when contiguous; a wire row's bytes in place)
    scales_stride,  # elements between scale rows (groups when contiguous)
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
    x_row = (row // x_inner) * x_outer + (row % x_inner) * x_stride
    v = tl.load(x_ptr + x_row + col, mask=in_block & (col < cols), other=0.0).to(tl.float32)
    offs = row * groups * GROUP_SIZE + col  # [BG, BGS] int64 index into [rows, groups*GROUP_SIZE]
    c, scale = tile_quantize(v, offs, seed, QMAX, STOCHASTIC)
    tl.store(scales_ptr + row * scales_stride + g, scale, mask=g < groups)
    tile_store_codes(codes_ptr + row * codes_stride, c, g, groups, GROUP_SIZE, BITS, BLOCK_G, BLOCK_GS)


@jit
def _dequantize_kernel(
    codes_ptr,  # *int8 / *uint8 [rows, row_bytes], input codes
    scales_ptr,  # *fp32 [rows, groups], input scales
    out_ptr,  # *fp32 / *bf16 / *fp16 [rows, cols] output rows (unit inner stride); its dtype is the result's
    cols,  # elements per row (unpadded)
    groups,  # blocks per row
    codes_stride,  # elements between code rows (row_bytes when contiguous)
    scales_stride,  # elements between scale rows (groups when contiguous)
    out_stride,  # elements between output rows (cols when contiguous)
    tiles_per_row,  # ceil(groups / BLOCK_G)
    GROUP_SIZE: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_GS: tl.constexpr,
):
    row, g, j, col = tile_coords(tiles_per_row, GROUP_SIZE, BLOCK_G, BLOCK_GS)
    c = tile_load_codes(codes_ptr + row * codes_stride, g, groups, GROUP_SIZE, BITS, BLOCK_G, BLOCK_GS)
    s = tl.load(scales_ptr + row * scales_stride + g, mask=g < groups, other=0.0)  # [BG]
    val = c * s[:, None]  # [BG, BGS] fp32, exactly the reference's code * scale
    mask = (j[None, :] < GROUP_SIZE) & (col < cols)
    tl.store(out_ptr + row * out_stride + col, to_out_dtype(val, out_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Launchers. Everything that depends only on (shape, dtype, bits, group size) - the checks of
# those, the layout, the tile, the grid, the compile options - is worked out once per key in a
# cached plan; a call then checks only what can differ between calls with the same key (seed,
# contiguity, the caller's buffers) and launches.
# ----------------------------------------------------------------------------------------------
PLAN_CACHE_SIZE = 4096
"""Launch plans kept per launcher (one per distinct shape/dtype/bits/group size in use)."""


class QuantizePlan:
    """Layout and launch of ``quantize`` for one (numel, rows, dtype, bits, group size, rounding,
    strides). ``strides`` is ``(x_inner, x_outer, x_stride, codes_stride, scales_stride)`` (see the
    kernel), None for contiguous input and output."""

    def __init__(
        self,
        numel: int,
        rows: int,
        dtype: torch.dtype,
        bits: int,
        group_size: int,
        stochastic: bool,
        strides: tuple[int, int, int, int, int] | None = None,
    ):
        check_bits(bits)  # the checks of check_quantize_args that depend on the key only
        check_group_size(group_size, bits)
        check_float_dtype(dtype, "input")
        self.cols = split_rows(numel, rows)
        self.rows, self.bits, self.group_size = rows, bits, group_size
        self.groups = num_groups(self.cols, group_size)
        self.row_bytes = row_bytes(self.cols, bits, group_size)
        self.codes_dtype = codes_dtype(bits)
        if strides is None:
            strides = (rows, 0, self.cols, self.row_bytes, self.groups)
        self.launch = None  # nothing to launch for an empty tensor
        if rows * self.groups:
            cfg = TileConfig(group_size, self.groups, rows)
            self.launch = LaunchPlan(
                _quantize_kernel,
                cfg,
                (self.cols, self.groups, *strides, cfg.tiles_per_row),
                dict(GROUP_SIZE=group_size, BITS=bits, QMAX=qmax(bits), STOCHASTIC=stochastic),
            )


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def quantize_plan(
    numel: int,
    rows: int,
    dtype: torch.dtype,
    bits: int,
    group_size: int,
    stochastic: bool,
    strides: tuple[int, int, int, int, int] | None = None,
) -> QuantizePlan:
    return QuantizePlan(numel, rows, dtype, bits, group_size, stochastic, strides)


class DequantizePlan:
    """Launch of ``dequantize`` for one (rows, cols, bits, group size, output dtype, strides);
    ``strides`` is ``(codes_stride, scales_stride, out_stride)``, None when all are contiguous."""

    def __init__(
        self,
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
        self.launch = None
        if rows * groups:
            cfg = TileConfig(group_size, groups, rows)
            self.launch = LaunchPlan(
                _dequantize_kernel,
                cfg,
                (cols, groups, *strides, cfg.tiles_per_row),
                dict(GROUP_SIZE=group_size, BITS=bits),
            )


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def dequantize_plan(
    rows: int,
    cols: int,
    bits: int,
    group_size: int,
    out_dtype: torch.dtype,
    strides: tuple[int, int, int] | None = None,
) -> DequantizePlan:
    return DequantizePlan(rows, cols, bits, group_size, out_dtype, strides)


def quantized_rows(q: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """``(codes, scales, codes row stride, scales row stride)`` for a kernel launch: ``q``'s own
    tensors when they are row-strided (views into a received wire buffer are), else contiguous
    copies (a layout the kernels cannot index)."""
    codes, scales = q.codes, q.scales
    cs, ss = row_stride(codes), row_stride(scales)
    if cs is None:
        codes = codes.contiguous()
        cs = codes.shape[-1]
    if ss is None:
        scales = scales.contiguous()
        ss = scales.shape[-1]
    return codes, scales, cs, ss


def _quantize_triton(
    x: torch.Tensor,
    bits: int,
    group_size: int,
    *,
    rows: int = 1,
    stochastic: bool = False,
    seed: int = 0,
    out: QuantizedTensor | None = None,
) -> QuantizedTensor:
    """Triton twin of ``quantize_ref`` (same checks, same result bit for bit), into ``out`` if given.

    ``x`` may be a row-strided or two-level view (``layout.row_geometry``: a swizzled view of the
    input reads in place), ``out`` row-strided views (codes and scales inside a wire buffer)."""
    seed = check_seed(seed)
    if not x.is_cuda:
        check_launchable(x)
    cols = split_rows(x.numel(), rows)
    geo = row_geometry(x, rows, cols) if rows else None
    if geo is None:
        x, geo = x.contiguous(), (rows, 0, cols)  # a layout the kernel cannot index: copy once
    if out is None:
        plan = quantize_plan(
            x.numel(),
            rows,
            x.dtype,
            bits,
            group_size,
            bool(stochastic),
            None if geo == (rows, 0, cols) else (*geo, row_bytes(cols, bits, group_size), num_groups(cols, group_size)),
        )
        codes = torch.empty(rows, plan.row_bytes, dtype=plan.codes_dtype, device=x.device)  # [rows, row_bytes]
        scales = torch.empty(rows, plan.groups, dtype=torch.float32, device=x.device)  # [rows, groups]
        out = QuantizedTensor.unchecked(codes, scales, plan.cols, bits, group_size)
    else:
        check_quantized_out(out, rows, cols, bits, group_size, x.device)
        strides = (*geo, row_stride(out.codes), row_stride(out.scales))
        plan = quantize_plan(x.numel(), rows, x.dtype, bits, group_size, bool(stochastic), strides)
    if plan.launch is not None:
        plan.launch((x, out.codes, out.scales), (seed if stochastic else 0,))
    return out


def _dequantize_triton(
    q: QuantizedTensor, *, out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Triton twin of ``dequantize_ref``: reads row-strided codes / scales (views into a wire
    buffer) in place and writes straight into ``out`` (contiguous, or row-strided ``[rows, cols]``)."""
    _, rows = check_dims(q, False, "dequantize")
    if not q.codes.is_cuda:
        check_launchable(q.codes)
    out, os_ = output_rows(out, rows, q.cols, dtype, q.codes.device)  # [rows, cols] or the caller's buffer
    codes, scales, cs, ss = quantized_rows(q)
    plan = dequantize_plan(rows, q.cols, q.bits, q.group_size, out.dtype, (cs, ss, os_))
    if plan.launch is not None:
        plan.launch((codes, scales, out))
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
    same layout (``[rows, *]`` codes and scales on ``x``'s device, each row contiguous and rows a
    fixed stride apart: for example views into a collective's wire buffer, where each row's codes
    and scales lie side by side) that receives the result and is returned; the Triton kernels
    write it in place. ``x`` may be a view whose rows are contiguous (``[rows, cols]`` with a row
    stride, or a two-level ``[a, b, cols]`` view such as qgZ's swizzled order,
    ``layout.row_geometry``): the Triton kernels read it in place; the CPU path reads long rows
    (``ROW_LOOP_MIN_COLS``) one by one when rounding to nearest, and copies it otherwise.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize takes a torch.Tensor, got {type(x).__name__}; e.g. quantize(torch.as_tensor(x))")
    if not isinstance(stochastic, bool):  # "no" would be read as truthy, or fail int() deep in a kernel
        raise TypeError(f"quantize's stochastic must be True or False, got {stochastic!r}")
    group_size = DEFAULT_WEIGHT_GROUP_SIZE if group_size is None else group_size
    if _use_triton(x, impl):
        return _quantize_triton(x, bits, group_size, rows=rows, stochastic=stochastic, seed=seed, out=out)
    if (
        out is not None
        and not stochastic
        and not x.is_contiguous()
        and x.dim() >= 2
        and rows == _lead(x)
        and x.shape[-1] >= ROW_LOOP_MIN_COLS
    ):
        # round to nearest is row-independent: quantize row views one by one instead of letting
        # the CPU path gather a contiguous copy of a strided (e.g. swizzled) input
        cols = x.shape[-1]
        check_quantized_out(out, rows, cols, bits, group_size, x.device)
        for r, xr in enumerate(_row_views(x)):
            quantize_cpu(xr, bits, group_size, out=_row_of(out, r))
        return out
    return quantize_cpu(x, bits, group_size, rows=rows, stochastic=stochastic, seed=seed, out=out)


ROW_LOOP_MIN_COLS = 1 << 15
"""On the CPU path, a strided input is quantized row by row (no gathered copy) from this many
columns per row on; shorter rows are cheaper to copy once than to quantize in separate calls
(measured on the dev machine: 8 rows of 16K elements took 3x longer row by row)."""


def _lead(x: torch.Tensor) -> int:
    n = 1
    for d in x.shape[:-1]:
        n *= d
    return n


def _row_views(x: torch.Tensor) -> list[torch.Tensor]:
    """The rows (last dim) of ``x`` in flattened order, as views."""
    return [x] if x.dim() == 1 else [r for part in x.unbind(0) for r in _row_views(part)]


def _row_of(q: QuantizedTensor, r: int) -> QuantizedTensor:
    """Row ``r`` of a ``[rows, *]`` QuantizedTensor as a one-row view (contiguous)."""
    return QuantizedTensor.unchecked(q.codes[r : r + 1], q.scales[r : r + 1], q.cols, q.bits, q.group_size)


def dequantize(
    q: QuantizedTensor, *, out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32, impl: str | None = None
) -> torch.Tensor:
    """QuantizedTensor -> ``[rows, cols]`` in ``dtype``, or written into ``out`` (contiguous with
    ``rows*cols`` elements, or a row-strided ``[rows, cols]`` view such as columns of a larger
    buffer; its dtype wins). Row-strided codes and scales (views into a received wire buffer)
    are read in place."""
    if _use_triton(q.codes, impl):
        return _dequantize_triton(q, out=out, dtype=dtype)
    if out is not None and not out.is_contiguous() and q.codes.dim() == 2:
        # a row-strided output (columns of a gathered buffer): one call per row, each writing a
        # contiguous row of it in place (row-strided codes and scales are read as views)
        _, rows = check_dims(q, False, "dequantize")
        out2, _ = output_rows(out, rows, q.cols, dtype, q.codes.device)
        rows_out = out2.view(rows, q.cols) if out2.is_contiguous() else out2
        for r in range(rows):
            dequantize_cpu(_row_of(q, r), out=rows_out[r])
        return out
    return dequantize_cpu(q, out=out, dtype=dtype)
