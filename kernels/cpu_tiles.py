"""The CPU path's tiles: the reference's arithmetic on cache-sized tiles, which need no compiler.

What ``cpu.py`` falls back to where neither the native kernels nor the compiled ones serve (small
tensors, the partial last block of each row, a host without a compiler), and what the other two
are measured against (``docs/benchmarks.md``).

``quantize_ref`` is written for reading: it pads the whole tensor, then makes a dozen full
passes (finiteness masks, ``where``s, a division, rounding, clamping, integer casts), each with a
full-size temporary. On a CPU that is memory-bound work, and a 16 MiB tensor streams through
memory a dozen times. This module does the same operations in the same order on tiles of about
``TILE_ELEMS`` elements, so each tile's temporaries stay in the core's cache, and drops the passes
that cannot change a result:

- absmax: ``amax(|v|)`` with no finiteness masks. A NaN or +-Inf anywhere in a block makes it
  non-finite, and its scale NaN and codes 0 whatever its finite absmax was, so the reference's
  finite-only absmax only matters for finite blocks, where both are ``max|v|``;
- ``code = clamp(floor(v / scale + 0.5))`` in place in one tile buffer; codes of non-finite and
  zero-scale blocks are zeroed only when such blocks exist;
- INT8 codes are cast straight from the fp32 tile; INT4 pairs are packed in fp32 as
  ``lo + 16 * hi + 136`` (= ``(lo + 8) | (hi + 8) << 4``, exact in fp32) and cast once.

The division stays an IEEE division (never a multiplication by the reciprocal) and stochastic
rounding uses the reference's Philox uniforms at the same padded offsets, so every code and scale
is bit-identical to ``quantize_ref`` (``tests/{unit,e2e}/test_kernels.py`` checks it on the awkward cases).

Dequantize, dequantize-sum and the fused dequantize-sum-requantize walk the same tiles: each
tile's ``code * scale`` products are added in index order onto zeros (the reference's order) in a
cache-resident accumulator, written out (or re-quantized) before the next tile, so no k
full-precision copies and no full-size fp32 sum are ever materialised.
"""

from __future__ import annotations

import torch

from .layout import QuantizedTensor, qmax
from .reference import philox_uniform

TILE_ELEMS = 1 << 16
"""Elements per tile: 256 KiB of fp32 input plus as much scratch stay in a 1 MiB L2 (measured on
the 2-core dev machine: about 2x faster than 8K-element tiles, no faster with 128K)."""


def quantize_tile(
    v: torch.Tensor,  # [r, g, gs] any float dtype, possibly strided (a view of the input)
    codes: torch.Tensor,  # [r, g, gs * bits / 8] int8 / uint8 view of the output codes
    scales: torch.Tensor,  # [r, g] fp32 view of the output scales
    buf: torch.Tensor,  # flat fp32 scratch of at least r * g * gs elements
    bits: int,
    stochastic: bool,
    seed: int,
    offsets: torch.Tensor | None,  # [r, g, gs] int64 padded-layout positions (stochastic only)
) -> None:
    q = qmax(bits)
    v = v.to(torch.float32)  # no copy for fp32 input
    t = buf[: v.numel()].view(v.shape)  # [r, g, gs] fp32 scratch, contiguous
    absmax = torch.abs(v, out=t).amax(dim=-1)  # [r, g]; NaN propagates through amax
    finite = torch.isfinite(absmax)
    scale = absmax / torch.tensor(float(q), dtype=torch.float32)  # the reference's expression
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
    torch.div(v, safe, out=t)
    if stochastic:
        assert offsets is not None, "stochastic rounding needs the padded-layout offsets"
        t.add_(philox_uniform(seed, offsets))
    else:
        t.add_(0.5)
    t.floor_().clamp_(-q, q)
    ok = finite & (scale > 0)
    if not bool(ok.all()):
        t.masked_fill_(~ok.unsqueeze(-1), 0.0)
        scale = scale.masked_fill(~finite, float("nan"))
    scales.copy_(scale)
    if bits == 8:
        codes.copy_(t)
    else:
        pairs = t.view(*t.shape[:-1], -1, 2)  # [r, g, gs/2, 2]: element 2i low nibble, 2i+1 high
        codes.copy_(torch.add(pairs[..., 0], pairs[..., 1], alpha=16).add_(136))


def tiles(rows: int, g: int, gs: int):
    """``(r0, r1, g0, g1)`` tiles of a ``[rows, g, gs]`` block layout, about ``TILE_ELEMS`` elements
    each: several whole rows, one whole row, or a run of blocks of one row."""
    gpt = max(1, TILE_ELEMS // gs)  # blocks per tile
    rpt = max(1, gpt // g) if g else 1  # rows per tile when whole rows fit
    step = g if rpt > 1 else gpt
    for r0 in range(0, rows, rpt):
        for g0 in range(0, g, step):
            yield r0, min(rows, r0 + rpt), g0, min(g, g0 + step)


def scratch(rows: int, g: int, gs: int) -> torch.Tensor:
    """A flat fp32 buffer as large as the largest tile of :func:`tiles`."""
    gpt = max(1, TILE_ELEMS // gs)
    rpt = max(1, gpt // g) if g else 1
    return torch.empty(min(rows * g, max(gpt, rpt * g)) * gs, dtype=torch.float32)


def offsets(r0: int, r1: int, g0: int, g1: int, groups_per_row: int, gs: int) -> torch.Tensor:
    """Padded-layout positions ``row * groups_per_row * gs + group * gs + lane`` of a tile
    ([r, g, gs] int64): where the reference draws each element's Philox uniform."""
    rr = torch.arange(r0, r1, dtype=torch.int64).view(-1, 1, 1) * (groups_per_row * gs)
    gg = torch.arange(g0, g1, dtype=torch.int64).view(1, -1, 1) * gs
    return rr + gg + torch.arange(gs, dtype=torch.int64)


def quantize_blocks(
    v: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    stochastic: bool,
    seed: int,
    first_group: int = 0,
    groups_per_row: int | None = None,
) -> None:
    """Quantize ``v`` ([rows, g, gs], complete blocks) into ``codes`` ([rows, g, gs*bits/8]) and
    ``scales`` ([rows, g]) tile by tile. ``first_group`` / ``groups_per_row`` place these blocks
    in the padded row for the stochastic-rounding offsets."""
    rows, g, gs = v.shape
    G = g if groups_per_row is None else groups_per_row
    buf = scratch(rows, g, gs)
    for r0, r1, g0, g1 in tiles(rows, g, gs):
        offs = offsets(r0, r1, first_group + g0, first_group + g1, G, gs) if stochastic else None
        quantize_tile(v[r0:r1, g0:g1], codes[r0:r1, g0:g1], scales[r0:r1, g0:g1], buf, bits, stochastic, seed, offs)


def dequantize_tile(codes: torch.Tensor, scales: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """codes [r, g, gs*bits/8] and scales [r, g] -> ``out`` [r, g, gs] fp32 = code * scale."""
    if bits == 8:
        out.copy_(codes)
    else:
        pairs = out.view(*out.shape[:-1], -1, 2)  # element 2i from the low nibble, 2i+1 from the high
        pairs[..., 0].copy_(codes & 0xF)
        pairs[..., 1].copy_(codes >> 4)
        out.sub_(8)
    out.mul_(scales.unsqueeze(-1))


def summed_tiles(q: QuantizedTensor, stacked: bool):
    """Yield ``(r0, r1, g0, g1, acc)``: each tile of ``q``'s blocks dequantized (``stacked``: the
    k inputs added in index order onto zeros, as the reference sums) into ``acc`` [r, g, gs] fp32,
    a scratch buffer that the next tile overwrites."""
    gs, bits = q.group_size, q.bits
    codes = q.codes if stacked else q.codes.unsqueeze(0)  # [k, rows, row_bytes]
    scales = q.scales if stacked else q.scales.unsqueeze(0)  # [k, rows, g]
    k, rows, g = scales.shape
    codes = codes.view(k, rows, g, gs * bits // 8)  # [k, rows, g, code bytes per block]
    acc_buf, tmp_buf = scratch(rows, g, gs), scratch(rows, g, gs)
    for r0, r1, g0, g1 in tiles(rows, g, gs):
        shape = (r1 - r0, g1 - g0, gs)
        acc = acc_buf[: shape[0] * shape[1] * gs].view(shape)
        if not stacked:
            dequantize_tile(codes[0, r0:r1, g0:g1], scales[0, r0:r1, g0:g1], bits, acc)
        else:
            acc.zero_()
            tmp = tmp_buf[: acc.numel()].view(shape)
            for i in range(k):
                dequantize_tile(codes[i, r0:r1, g0:g1], scales[i, r0:r1, g0:g1], bits, tmp)
                acc.add_(tmp)
        yield r0, r1, g0, g1, acc


def write_tiles(q: QuantizedTensor, stacked: bool, out: torch.Tensor) -> torch.Tensor:
    """Dequantized (summed) blocks of ``q`` into ``out`` ([rows, cols] worth, any float dtype)."""
    gs, cols = q.group_size, q.cols
    dst = out.view(q.rows, cols)
    for r0, r1, g0, g1, acc in summed_tiles(q, stacked):
        a, b = g0 * gs, min(g1 * gs, cols)
        dst[r0:r1, a:b].copy_(acc.view(r1 - r0, -1)[:, : b - a])  # drops the padding, rounds to out's dtype
    return out
