"""Shared Triton building blocks: tile-level quantize / code load / code store, and launch helpers.

Every kernel in ``quantize.py`` and ``reduce.py`` works on the same tile: ``BLOCK_G`` blocks of one
row, each block padded to ``BLOCK_GS = next_power_of_2(group_size)`` lanes (``tl.arange`` needs a
power of two; lanes at or past ``group_size`` are masked, so any group size works). The helpers
below reproduce ``reference.py`` operation for operation so that results are bit-identical:
IEEE divisions (``tl.math.div_rn``; plain ``/`` is approximate on GPU), ``floor(v + 0.5)``
rounding, Philox uniforms indexed by the padded ``[rows, groups * group_size]`` position, and
fp-fusion disabled at launch so that ``acc + code * scale`` is never contracted into an FMA.

Triton is optional at import time (it is Linux-only): without it the module still imports, the
kernels are plain undecorated functions, and the launchers raise a clear error.
"""

from __future__ import annotations

import contextlib
import os

import torch

try:  # pragma: no cover - exercised implicitly on every platform that has triton
    import triton
    import triton.language as tl

    HAS_TRITON = True
    jit = triton.jit
except ImportError:  # pragma: no cover - non-Linux installs
    triton = None
    tl = None
    HAS_TRITON = False

    def jit(fn):  # type: ignore[no-redef]
        return fn


_FLT_MAX = 3.4028234663852886e38
FLT_MAX = tl.constexpr(_FLT_MAX) if HAS_TRITON else _FLT_MAX  # jit code may read constexpr globals only
"""Largest finite fp32; ``|v| <= FLT_MAX`` is false exactly for NaN and +-Inf."""

TILE_ELEMS = 4096
"""Elements per program (BLOCK_G * BLOCK_GS) for small groups: 16 KiB of fp32 in flight per
program, enough for full-bandwidth loads on H100-class GPUs without register spills."""

MAX_BLOCK_GS = 1 << 20
"""Triton's largest tensor (TRITON_MAX_TENSOR_NUMEL): one block must fit in one tile."""

LAUNCH_OPTS = {"enable_fp_fusion": False, "enable_reflect_ftz": False}
"""Compile options that make GPU results match the torch reference bit for bit: keep mul and add
separate (no FMA contraction of ``acc + code * scale``), and keep subnormals in libdevice's
``div_rn`` (Triton's NVIDIA default flushes them to zero, the CPU does not)."""


def launch_opts() -> dict:
    """LAUNCH_OPTS minus what this build's backend does not know (Triton rejects unknown launch
    keywords; ``enable_reflect_ftz`` exists only for NVIDIA)."""
    if torch.version.hip is not None:
        return {"enable_fp_fusion": False}
    return dict(LAUNCH_OPTS)


# ----------------------------------------------------------------------------------------------
# Tile helpers (inlined into the kernels).
# ----------------------------------------------------------------------------------------------
@jit
def tile_coords(tiles_per_row, GROUP_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_GS: tl.constexpr):
    """This program's tile: program id -> (row, tile of the row). Returns ``(row, g, j, col)``:
    the int64 row, its blocks ``g`` [BG] (int64), the lanes ``j`` [BGS] and each lane's position
    ``col = g * GROUP_SIZE + j`` [BG, BGS] in the padded row."""
    pid = tl.program_id(0).to(tl.int64)
    row = pid // tiles_per_row
    g = (pid % tiles_per_row) * BLOCK_G + tl.arange(0, BLOCK_G).to(tl.int64)  # [BG]
    j = tl.arange(0, BLOCK_GS)  # [BGS]
    col = g[:, None] * GROUP_SIZE + j[None, :]  # [BG, BGS]
    return row, g, j, col


@jit
def tile_quantize(v, offs, seed, QMAX: tl.constexpr, STOCHASTIC: tl.constexpr):
    """v: [BG, BGS] fp32 (masked lanes 0); offs: [BG, BGS] int64 padded-layout index.

    Returns (codes [BG, BGS] fp32 holding integers in -QMAX..QMAX, scales [BG] fp32). Finiteness
    is tested explicitly rather than trusting tl.max to propagate NaN.
    """
    fin = tl.abs(v) <= FLT_MAX  # [BG, BGS]; False for NaN and +-Inf
    block_finite = tl.sum((fin == 0).to(tl.int32), axis=1) == 0  # [BG]
    absmax = tl.max(tl.where(fin, tl.abs(v), 0.0), axis=1)  # [BG]
    scale = tl.math.div_rn(absmax, tl.full(absmax.shape, QMAX, tl.float32))  # [BG]
    safe = tl.where(scale > 0.0, scale, 1.0)  # [BG]
    t = tl.math.div_rn(v, tl.broadcast_to(safe[:, None], v.shape))  # [BG, BGS]
    if STOCHASTIC:
        t = t + tl.rand(seed, offs)
    else:
        t = t + 0.5
    c = tl.floor(t)
    c = tl.minimum(tl.maximum(c, -QMAX * 1.0), QMAX * 1.0)
    keep = block_finite & (scale > 0.0)  # [BG]
    c = tl.where(keep[:, None], c, 0.0)
    nan = tl.full(scale.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    scale = tl.where(block_finite, scale, nan)
    return c, scale


@jit
def to_out_dtype(val, OUT_DTYPE: tl.constexpr):
    """fp32 -> OUT_DTYPE with round-to-nearest-even, as torch's ``.to`` does.

    For bf16 the rounding is done by hand on the bits: the GPU's conversion is RNE but the
    interpreter's truncates, and the tests compare interpreter output with torch bit for bit.
    After the integer rounding the low 16 bits are zero, so the final cast is exact everywhere.
    """
    if OUT_DTYPE == tl.bfloat16:
        bits = val.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        val = tl.where(val == val, bits.to(tl.float32, bitcast=True), val)  # NaN passes untouched
    return val.to(OUT_DTYPE)


@jit
def tile_load_codes(
    row_codes_ptr,  # *int8 (BITS 8) or *uint8 (BITS 4): first code byte of this row
    g,  # [BG] int64 block indices of this tile
    groups,  # blocks per row
    GROUP_SIZE: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_GS: tl.constexpr,
):
    """Stored codes of blocks ``g`` -> fp32 codes [BG, BGS] (lanes outside the block are 0)."""
    if BITS == 8:
        j = tl.arange(0, BLOCK_GS)
        mask = (j[None, :] < GROUP_SIZE) & (g[:, None] < groups)  # [BG, BGS]
        c = tl.load(row_codes_ptr + g[:, None] * GROUP_SIZE + j[None, :], mask=mask, other=0)
        return c.to(tl.float32)
    else:
        i = tl.arange(0, BLOCK_GS // 2)
        mask = (i[None, :] < GROUP_SIZE // 2) & (g[:, None] < groups)  # [BG, BGS/2]
        b = tl.load(row_codes_ptr + g[:, None] * (GROUP_SIZE // 2) + i[None, :], mask=mask, other=0x88)
        b = b.to(tl.int32)
        lo = ((b & 0xF) - 8).to(tl.float32)  # element 2i
        hi = ((b >> 4) - 8).to(tl.float32)  # element 2i+1
        return tl.reshape(tl.join(lo, hi), (BLOCK_G, BLOCK_GS))


@jit
def tile_store_codes(
    row_codes_ptr,  # *int8 (BITS 8) or *uint8 (BITS 4): first code byte of this row
    c,  # [BG, BGS] fp32 integer-valued codes
    g,  # [BG] int64 block indices of this tile
    groups,  # blocks per row
    GROUP_SIZE: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_GS: tl.constexpr,
):
    """Store a tile's codes in the layout.py format (INT4: 2i low nibble, 2i+1 high, code + 8)."""
    if BITS == 8:
        j = tl.arange(0, BLOCK_GS)
        mask = (j[None, :] < GROUP_SIZE) & (g[:, None] < groups)
        tl.store(row_codes_ptr + g[:, None] * GROUP_SIZE + j[None, :], c.to(tl.int8), mask=mask)
    else:
        i = tl.arange(0, BLOCK_GS // 2)
        mask = (i[None, :] < GROUP_SIZE // 2) & (g[:, None] < groups)
        lo, hi = tl.split(tl.reshape(c, (BLOCK_G, BLOCK_GS // 2, 2)))  # [BG, BGS/2] each
        packed = (lo.to(tl.int32) + 8) | ((hi.to(tl.int32) + 8) << 4)
        tl.store(row_codes_ptr + g[:, None] * (GROUP_SIZE // 2) + i[None, :], packed.to(tl.uint8), mask=mask)


# ----------------------------------------------------------------------------------------------
# Host-side launch helpers.
# ----------------------------------------------------------------------------------------------
class TileConfig:
    """Tile shape and warps for one group size: ``BLOCK_G`` blocks x ``BLOCK_GS`` lanes."""

    def __init__(self, group_size: int, groups: int) -> None:
        self.block_gs = triton.next_power_of_2(group_size)
        if self.block_gs > MAX_BLOCK_GS:
            raise ValueError(
                f"group_size={group_size} exceeds the Triton kernels' largest block ({MAX_BLOCK_GS} "
                f"elements); use a smaller group size or impl='torch'"
            )
        per_tile = max(1, TILE_ELEMS // self.block_gs)
        self.block_g = min(per_tile, triton.next_power_of_2(max(groups, 1)))
        elems = self.block_g * self.block_gs
        self.num_warps = 4 if elems <= 4096 else 8 if elems <= 16384 else 16
        self.tiles_per_row = triton.cdiv(groups, self.block_g)

    def meta(self) -> dict:
        return dict(BLOCK_G=self.block_g, BLOCK_GS=self.block_gs, num_warps=self.num_warps, **launch_opts())


def on_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device: make it ``t``'s (a no-op on CPU)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def check_launchable(t: torch.Tensor) -> None:
    """Fail clearly instead of deep inside Triton when the kernels cannot run on ``t``."""
    if not HAS_TRITON:
        raise RuntimeError("impl='triton' needs the triton package (Linux only); use impl='torch'")
    if not t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before triton is imported; "
            "otherwise use impl='torch' or CUDA tensors"
        )
