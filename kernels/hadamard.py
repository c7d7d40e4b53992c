"""Blockwise Walsh-Hadamard rotation (SDP4Bit): spread each block's outliers over the block before
quantizing, so one large element no longer sets a coarse scale for all its neighbours.

``hadamard(x, block)`` multiplies every ``block`` consecutive elements of each row by the
normalised Sylvester Hadamard matrix ``H / sqrt(block)``; that matrix is symmetric and
orthogonal, so the same call undoes it. Rows are zero padded to whole blocks first
(``rotated_cols``), so any row length works; the inverse keeps the original length with
``out_cols``. The specification, and the CPU path, is ``reference.hadamard_ref`` (vectorised torch,
one pass per butterfly stage); the Triton kernel below does the same fp32 butterflies in
registers, in the same order, and matches it bit for bit.

The transform is linear, which the int codec's Hadamard mode uses (``zeropp.comm.codecs``): sums
of rotated values are rotated sums, so qgZ reduces and re-quantizes in the rotated basis and
rotates back only once, after the last sum.
"""

from __future__ import annotations

import functools

import torch

from ._triton import LaunchPlan, TileConfig, check_launchable, jit, tile_coords, tl, to_out_dtype
from .layout import output_rows, row_geometry
from .reference import (
    MAX_HADAMARD_BLOCK,
    check_hadamard_args,
    check_hadamard_block,
    hadamard_ref,
    hadamard_scale,
    rotated_cols,
)

__all__ = ["MAX_HADAMARD_BLOCK", "hadamard", "hadamard_ref", "rotated_cols"]


@jit
def _hadamard_kernel(
    x_ptr,  # *fp32 / *bf16 / *fp16 input rows, read through its own dtype
    out_ptr,  # *fp32 / *bf16 / *fp16 [rows, out_cols] output rows (unit inner stride); its dtype is the result's
    cols,  # input elements per row (the rest of the last block is zero)
    out_cols,  # output elements per row (<= blocks * BLOCK_GS)
    blocks,  # rotation blocks per row = ceil(cols / BLOCK_GS)
    x_inner,  # input row r starts at (r // x_inner) * x_outer + (r % x_inner) * x_stride
    x_outer,
    x_stride,
    out_stride,  # elements between output rows
    tiles_per_row,  # ceil(blocks / BLOCK_G)
    GROUP_SIZE: tl.constexpr,  # the rotation block (= BLOCK_GS, a power of two)
    LOG2_BLOCK: tl.constexpr,
    SCALE: tl.constexpr,  # hadamard_scale(block): an fp32 value
    BLOCK_G: tl.constexpr,  # blocks per program
    BLOCK_GS: tl.constexpr,
):
    row, g, _j, col = tile_coords(tiles_per_row, GROUP_SIZE, BLOCK_G, BLOCK_GS)
    x_row = (row // x_inner) * x_outer + (row % x_inner) * x_stride
    v = tl.load(x_ptr + x_row + col, mask=(g[:, None] < blocks) & (col < cols), other=0.0).to(tl.float32)
    # stage s: lanes i and i + h (h = 2**s, bit s of i clear) -> (a + b, a - b), as hadamard_ref
    # (unrolled: s is a constexpr, so the shapes below are compile-time constants)
    for s in tl.static_range(LOG2_BLOCK):
        # [BG, pairs, 2, h] with h = 2**s, pairs = BLOCK_GS / 2h -> [BG, pairs, h, 2]
        v4 = tl.permute(tl.reshape(v, (BLOCK_G, BLOCK_GS // (2 << s), 2, 1 << s)), (0, 1, 3, 2))
        a, b = tl.split(v4)  # [BG, pairs, h] each
        v4 = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))  # [BG, pairs, 2, h]
        v = tl.reshape(v4, (BLOCK_G, BLOCK_GS))
    v = v * SCALE
    mask = (g[:, None] < blocks) & (col < out_cols)
    tl.store(out_ptr + row * out_stride + col, to_out_dtype(v, out_ptr.dtype.element_ty), mask=mask)


class HadamardPlan:
    """Launch of ``hadamard`` for one (rows, cols, out_cols, block, strides); ``strides`` is
    ``(x_inner, x_outer, x_stride, out_stride)``."""

    def __init__(self, rows: int, cols: int, out_cols: int, block: int, strides: tuple[int, int, int, int]):
        check_hadamard_block(block)
        blocks = rotated_cols(cols, block) // block
        self.launch = None  # nothing to launch for an empty result
        if rows * blocks and out_cols:
            cfg = TileConfig(block, blocks, rows)
            self.launch = LaunchPlan(
                _hadamard_kernel,
                cfg,
                (cols, out_cols, blocks, *strides, cfg.tiles_per_row),
                dict(GROUP_SIZE=block, LOG2_BLOCK=block.bit_length() - 1, SCALE=hadamard_scale(block)),
            )


@functools.lru_cache(maxsize=4096)
def hadamard_plan(rows: int, cols: int, out_cols: int, block: int, strides: tuple[int, int, int, int]) -> HadamardPlan:
    return HadamardPlan(rows, cols, out_cols, block, strides)


def _hadamard_triton(
    x: torch.Tensor, block: int, *, rows: int, out_cols: int | None, out: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """Triton twin of ``hadamard_ref``: reads a row-strided or two-level view of ``x`` in place
    (``layout.row_geometry``) and writes ``out`` (contiguous, or row-strided ``[rows, out_cols]``)."""
    if not x.is_cuda:
        check_launchable(x)
    cols, _, out_cols = check_hadamard_args(x, block, rows, out_cols)
    geo = row_geometry(x, rows, cols)
    if geo is None:
        x, geo = x.contiguous(), (rows, 0, cols)  # a layout the kernel cannot index: copy once
    out, os_ = output_rows(out, rows, out_cols, dtype, x.device)  # [rows, out_cols] or the caller's buffer
    plan = hadamard_plan(rows, cols, out_cols, block, (*geo, os_))
    if plan.launch is not None:
        plan.launch((x, out))
    return out


def hadamard(
    x: torch.Tensor,
    block: int,
    *,
    rows: int = 1,
    out_cols: int | None = None,
    out: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    impl: str | None = None,
) -> torch.Tensor:
    """Normalised blockwise Walsh-Hadamard transform of ``x`` (fp32/bf16/fp16, numel divisible
    by ``rows``) as ``rows`` rows; its own inverse. Returns ``[rows, out_cols]`` in ``dtype``
    (or ``out``, whose dtype wins).

    ``block``: a power of two (2 .. ``MAX_HADAMARD_BLOCK``). Each row is zero padded to
    ``rotated_cols(cols, block)`` and each block rotated; ``out_cols`` keeps that many leading
    columns (default: the whole padded row; pass the original ``cols`` to undo a rotation).
    Computed in fp32 and rounded once to the output dtype. CUDA tensors take the Triton kernel,
    CPU tensors the torch reference (``impl="torch"`` / ``"triton"`` force one; the kernel on
    CPU needs ``TRITON_INTERPRET=1``). Both give the same bits (see ``reference.hadamard_ref``).
    """
    use_triton = x.is_cuda if impl is None else impl == "triton"
    if impl not in (None, "torch", "triton"):
        raise ValueError(f"impl must be None (auto), 'triton' or 'torch', got {impl!r}")
    if use_triton:
        return _hadamard_triton(x, block, rows=rows, out_cols=out_cols, out=out, dtype=dtype)
    return hadamard_ref(x, block, rows=rows, out_cols=out_cols, out=out, dtype=dtype)
