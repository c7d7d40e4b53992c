"""Shared Triton building blocks: tile-level quantize / code load / code store, and launch helpers.

Every kernel in ``quantize.py`` and ``reduce.py`` works on the same tile: ``BLOCK_G`` blocks of one
row, each block padded to ``BLOCK_GS = next_power_of_2(group_size)`` lanes (``tl.arange`` needs a
power of two; lanes at or past ``group_size`` are masked, so any group size works). The helpers
below reproduce ``reference.py`` operation for operation so that results are bit-identical:
IEEE divisions (``tl.math.div_rn``; plain ``/`` is approximate on GPU), ``floor(v + 0.5)``
rounding, Philox uniforms indexed by the padded ``[rows, groups * group_size]`` position
(:func:`stochastic_uniform`, the stream ``reference.philox_uniform`` defines), and
fp-fusion disabled at launch so that ``acc + code * scale`` is never contracted into an FMA.

Triton is optional at import time (it is Linux-only): without it the module still imports, the
kernels are plain undecorated functions, and the launchers raise a clear error.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from .layout import MAX_GROUP_SIZE, check_group_size

try:  # pragma: no cover - exercised implicitly on every platform that has triton
    import triton
    import triton.language as tl

    HAS_TRITON = True
    jit = triton.jit
    try:
        from triton import knobs  # Triton >= 3.3: the launch hooks a direct launch must honour
    except ImportError:
        knobs = None
except ImportError:  # pragma: no cover - non-Linux installs
    triton = None
    tl = None
    knobs = None
    HAS_TRITON = False

    def jit(fn):
        return fn


_FLT_MAX = 3.4028234663852886e38
FLT_MAX = tl.constexpr(_FLT_MAX) if HAS_TRITON else _FLT_MAX  # jit code may read constexpr globals only
"""Largest finite fp32; ``|v| <= FLT_MAX`` is false exactly for NaN and +-Inf."""

TILE_ELEMS = 4096
"""Elements per program (BLOCK_G * BLOCK_GS) for small groups: 16 KiB of fp32 in flight per
program, enough for full-bandwidth loads on H100-class GPUs without register spills."""

MAX_BLOCK_GS = MAX_GROUP_SIZE
"""Largest block lanes per program: ``layout.MAX_GROUP_SIZE`` (a power of two, so the padded block
of the largest group fits), far below Triton's largest tensor (TRITON_MAX_TENSOR_NUMEL = 2**20)."""

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
def stochastic_uniform(seed, offs):
    """The stochastic-rounding uniforms at int64 padded-layout offsets ``offs`` (any shape), by
    the rule of ``reference.philox_uniform``: word ``offs % 4`` of ``tl.randint4x`` at counter
    ``offs // 4``, converted as ``tl.rand`` converts. Each element selects its own word (one Philox
    evaluation per element, as ``tl.rand``): a tile's offsets are not runs of four when the group
    size is not a multiple of four or the block is padded to a power of two."""
    w0, w1, w2, w3 = tl.randint4x(seed, offs // 4)
    lane = offs % 4
    w = tl.where(lane == 0, w0, tl.where(lane == 1, w1, tl.where(lane == 2, w2, w3)))
    return tl.random.uint_to_uniform_float(w)


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
        t = t + stochastic_uniform(seed, offs)
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
    if tl.bfloat16 == OUT_DTYPE:
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
SMALL_ELEMS = 132 * TILE_ELEMS
"""Below this many (padded) elements a launch has fewer full tiles than an H100 has SMs: halve the
tile so that more SMs get work."""

LARGE_ELEMS = 1 << 26
"""From this many (padded) elements on, tiles of twice TILE_ELEMS with 8 warps halve the number of
programs; per-program overhead (index math, scale stores) is amortised over more bytes."""


class TileConfig:
    """Tile shape and warps for one launch: ``BLOCK_G`` blocks x ``BLOCK_GS`` lanes per program.

    The tile's element count is chosen by size class (``rows * groups * block`` padded elements):
    small launches take half tiles (more programs than SMs), large ones double tiles with more
    warps, everything else ``TILE_ELEMS``. A block never spans two programs, so a group size
    larger than the tile gets one block per program.
    """

    def __init__(self, group_size: int, groups: int, rows: int = 1) -> None:
        if not HAS_TRITON:
            raise RuntimeError("impl='triton' needs the triton package (Linux only); use impl='torch'")
        self.block_gs = triton.next_power_of_2(group_size)
        if self.block_gs > MAX_BLOCK_GS:  # the plans check first; a direct caller gets the same message
            check_group_size(group_size, 8)
        total = rows * groups * self.block_gs
        tile = TILE_ELEMS // 2 if total < SMALL_ELEMS else 2 * TILE_ELEMS if total >= LARGE_ELEMS else TILE_ELEMS
        self.block_g = min(max(1, tile // self.block_gs), triton.next_power_of_2(max(groups, 1)))
        elems = self.block_g * self.block_gs
        self.num_warps = 4 if elems <= 4096 else 8 if elems <= 16384 else 16
        self.tiles_per_row = triton.cdiv(groups, self.block_g)
        self.grid = rows * self.tiles_per_row

    def meta(self) -> dict:
        return dict(BLOCK_G=self.block_g, BLOCK_GS=self.block_gs, num_warps=self.num_warps, **launch_opts())


DIRECT_LAUNCH = knobs is not None and os.environ.get("ZEROPP_TRITON_DIRECT_LAUNCH", "1") != "0"
"""Launch compiled kernels through their bound launcher (``LaunchPlan``) instead of
``kernel[grid](...)`` on every call: on an H100 (torch 2.11, Triton 3.6) it cut the host cost of one
quantize from 30 to 22 us. On by default since its specialisation key was checked against Triton's
own on that GPU (``tests/gpu/test_kernels_cuda.py::test_bound_launches_on_cuda_bit_exact``);
``ZEROPP_TRITON_DIRECT_LAUNCH=0`` goes back to Triton's own launch path (a key that missed a
specialisation would launch a kernel compiled for other alignments)."""


def _int_traits(v: int) -> tuple[bool, bool, bool, bool]:
    """What Triton's specialisation of an int argument depends on: equal to 1 (becomes a
    constant), divisible by 16 (an alignment hint), and its type (i32, i64 or u64 by range)."""
    return (v == 1, v % 16 == 0, -(2**31) <= v < 2**31, v < 2**63)


class LaunchPlan:
    """One kernel with everything about its launch fixed except the tensors and a few per-call ints.

    Built once per (kernel, shape, dtype, bits, group size, ...) by the launchers' plan caches,
    so grid, tile, warps and compile options are computed once. Calling it launches
    ``kernel[grid](*tensors, *ints, *scalars, **meta)``: the kernels take their pointers first,
    then the fixed ints (sizes), then the per-call ints (a seed), then the constexprs.

    On CUDA the first launch per specialisation goes through ``kernel[grid]`` (Triton compiles,
    caches, launches) and keeps the compiled kernel; later launches call its launcher directly,
    skipping Triton's per-call argument binding, specialisation and cache-key work. The
    specialisation key is what Triton would specialise on for these arguments: the device, each
    pointer's dtype and 16-byte alignment and the per-call ints' traits (``_int_traits``); the
    fixed ints are part of the plan's own cache key. Launch hooks (profilers) are honoured as Triton's own launch does.
    """

    def __init__(self, kernel, cfg: TileConfig, ints: tuple[int, ...], consts: dict) -> None:
        self.kernel = kernel
        self.cfg = cfg
        self.grid = cfg.grid
        self.ints = ints
        self.meta = dict(consts, **cfg.meta())
        names = getattr(kernel, "arg_names", None) or list(self.meta)
        self.const_values = tuple(self.meta[n] for n in names if n in self.meta)  # in parameter order
        self.bound: dict[tuple, Any] = {}  # specialisation key -> compiled kernel (Triton is untyped)

    def __call__(self, tensors: tuple[torch.Tensor, ...], scalars: tuple[int, ...] = ()) -> None:
        t0 = tensors[0]
        if not (t0.is_cuda and DIRECT_LAUNCH):
            with on_device(t0):
                self.kernel[(self.grid,)](*tensors, *self.ints, *scalars, **self.meta)
            return
        dev = t0.device.index
        # dtypes too: a plan may be shared by inputs of several dtypes (one compiled kernel each)
        key = (dev, tuple((t.dtype, t.data_ptr() % 16 == 0) for t in tensors), tuple(map(_int_traits, scalars)))
        compiled = self.bound.get(key)
        if compiled is not None and dev == current_device():
            # the launch lines of Triton's JITFunction.run, minus binding and cache lookup
            args = (*tensors, *self.ints, *scalars, *self.const_values)
            stream = current_stream(dev)
            hooks = knobs.runtime
            compiled.run(
                self.grid,
                1,
                1,
                stream,
                compiled.function,
                compiled.packed_metadata,
                compiled.launch_metadata((self.grid,), stream, *args),
                hooks.launch_enter_hook,
                hooks.launch_exit_hook,
                *args,
            )
            return
        with on_device(t0):
            compiled = self.kernel[(self.grid,)](*tensors, *self.ints, *scalars, **self.meta)
        if hasattr(compiled, "packed_metadata"):  # a CompiledKernel (not the interpreter's result)
            self.bound[key] = compiled


def current_device() -> int:
    """The current CUDA device, as Triton's launch reads it."""
    return triton.runtime.driver.active.get_current_device()


def current_stream(device: int) -> int:
    """The raw handle of torch's current stream on ``device``, as Triton's launch reads it."""
    return triton.runtime.driver.active.get_current_stream(device)


def on_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device: make it ``t``'s (a no-op on CPU and when it
    already is the current device)."""
    if t.is_cuda and t.device.index != current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def check_launchable(t: torch.Tensor) -> None:
    """Fail clearly instead of deep inside Triton when the kernels cannot run on ``t``."""
    if not HAS_TRITON:
        raise RuntimeError("impl='triton' needs the triton package (Linux only); use impl='torch'")
    if not t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before triton is imported; "
            "otherwise use impl='torch' or CUDA tensors"
        )
