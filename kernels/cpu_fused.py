"""The reference's arithmetic as single-pass formulations for ``torch.compile`` (inductor's C++
CPU code generation): the CPU path for tensors of at least ``FUSED_MIN_ELEMS`` elements where
the native kernels (``cpu_native.py``, 2-3x faster again) cannot be built.

Approaches measured on the 2-core dev machine, one thread (``docs/benchmarks.md``): fused eager
torch ops on cache-sized tiles (``cpu.py``, the path before this one) stay at six to eight passes
per tile; this module, compiled, is 2-3x faster at bucket sizes and 11-17x with stochastic
rounding (whose Philox is integer arithmetic that inductor vectorises). Formulations that
inductor turned into scalar loops were replaced: a symbolic group size (so the group size is a
constant of each kernel, only the block count is dynamic), stack/stride-2 interleaving of INT4
nibbles (replaced by the byte-pair tricks below).

Why compiled, not fused eager ops: quantize needs, per element, a load, a division, an add, a
floor, a clamp, a select and a narrowing store. Eager torch runs each as its own pass with its
own temporary; even on cache-resident tiles (``cpu.py``) that is six to eight passes and an
operator dispatch per pass and tile. Inductor emits one vectorised loop per block: the absmax
reduction and the code computation read each block while it is still in L1, nothing but the
codes and scales is written, and bf16/fp16 inputs are widened in registers.

Why it stays bit-identical to ``reference.py`` (``tests/{unit,e2e}/test_kernels.py`` checks it on the awkward
cases, through both this path and the tiled one):

- inductor compiles its C++ with ``-ffp-contract=off`` (no fused multiply-adds) and without
  ``-funsafe-math-optimizations`` (no reciprocal or reassociation rewrites), and on CPU it keeps a
  division by a constant a division (it rewrites it to a reciprocal multiply only on GPU);
  each operation below is an IEEE fp32 operation in the reference's order;
- absmax is ``amax(|v|)`` without the reference's finiteness masks: inductor's max reduction
  propagates NaN, so a block holding NaN or +-Inf gets a non-finite absmax, hence scale NaN and
  codes 0 as in the reference; in a finite block both are ``max|v|`` (``|-0.0| = +0.0``);
- the sum of k dequantized inputs is written as the reference's loop, ``acc = 0; acc = acc + d_i``
  in index order (``0.0 + -0.0`` is ``+0.0``, so the leading zero is kept, not folded away);
- INT4 nibbles are packed and unpacked with integer bit operations on byte pairs read as
  little-endian int16 (``lo | hi << 8`` <-> ``lo | hi << 4``), exact by construction;
- stochastic rounding calls the reference's own Philox (``reference.philox_uniform``) on the same
  padded-layout offsets; it is integer arithmetic, exact in any evaluation order. The seed is a
  tensor argument, so a new seed does not recompile.

Every variant (op, bits, group size, dtypes, stochastic, k) is compiled once per process (about
10-30 s on the 2-core dev machine; inductor's on-disk cache makes later processes much faster)
with dynamic row and column counts, so bucket shapes do not recompile. Each variant gets its own
code object, so dynamo's per-function recompile limit (8) never sends a variant back to eager.
If compilation fails (no C++ compiler), ``cpu.py`` warns once and keeps using the tiled path.
"""

from __future__ import annotations

import sys
import threading
import types
from typing import Callable

import torch

from .layout import qmax
from .reference import philox_uniform

AVAILABLE = sys.byteorder == "little"
"""INT4 (un)packing reads byte pairs as little-endian int16 (x86, ARM); elsewhere ``cpu.py`` keeps
to its tiles."""

FUSED_MIN_ELEMS = 1 << 15
"""Inputs (elements per tensor) from which CPU ranks take the compiled path. Below it the tiled
eager path (``cpu.py``) is as fast (a compiled call costs a few tens of microseconds of Python
around the kernel), and small tensors never pay a compilation."""

DEQUANTIZE_MIN_ELEMS = 1 << 17
"""The same for a plain dequantize: its tiles are cheap (a cast and a multiply), so the compiled
call's fixed cost only pays off from here (measured: 64 KiB of bf16 took 58 us compiled, 37 us tiled;
256 KiB 70 us and 82 us)."""


# ----------------------------------------------------------------------------------------------
# The formulations. Shapes are symbolic (dynamic rows / cols); bits, group size, k and the
# output dtype are Python constants baked into each compiled variant.
# ----------------------------------------------------------------------------------------------
def _quantize_blocks(v, codes_out, scales_out, seed, base, *, bits: int, stochastic: bool) -> None:
    """v [n, gs] blocks (any float dtype) -> codes_out [n, gs * bits / 8] int8 / uint8 and
    scales_out [n] fp32, written in place. ``base`` (int64 0-d) is the padded-layout offset of
    the first block's first element, where stochastic rounding draws its uniforms."""
    q = qmax(bits)
    n, gs = v.shape
    v = v.to(torch.float32)  # exact widening of bf16 / fp16
    absmax = v.abs().amax(dim=-1)  # [n]; NaN / Inf propagate (see the module docstring)
    finite = torch.isfinite(absmax)
    scale = absmax / float(q)  # an IEEE division on CPU, as the reference's
    safe = torch.where(scale > 0, scale, 1.0).unsqueeze(-1)  # [n, 1]
    t = v / safe  # [n, gs]
    if stochastic:
        offs = base + torch.arange(n * gs, dtype=torch.int64, device=v.device).view(n, gs)
        t = t + philox_uniform(seed, offs)
    else:
        t = t + 0.5
    ok = (finite & (scale > 0)).unsqueeze(-1)
    codes = torch.where(ok, torch.floor(t).clamp(-q, q), 0.0)  # [n, gs] fp32 integers
    scales_out.copy_(torch.where(finite, scale, float("nan")))
    if bits == 8:
        codes_out.copy_(codes)
    else:
        # nibbles code + 8 as bytes; byte pairs read as little-endian int16: lo | hi << 8 -> lo | hi << 4
        u = (codes + 8.0).to(torch.uint8).view(torch.int16)  # [n, gs / 2]
        codes_out.copy_(((u | (u >> 4)) & 0xFF).to(torch.uint8))


def _dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor, bits: int, wide: bool) -> torch.Tensor:
    """codes [n, bpg] and scales [n] -> fp32 [n, gs] = code * scale. ``wide``: INT4 byte pairs are
    read as int16 and spread to four nibble bytes in one int32 (vectorised by inductor, unlike
    interleaving stores or int16 arithmetic); it needs an even byte count and an even offset."""
    if bits == 8:
        c = codes.to(torch.float32)
    elif wide:
        w = codes.view(torch.int16).to(torch.int32)  # [n, bpg / 2]: b0 | b1 << 8 (sign-extended)
        u = (w & 0xF) | ((w & 0xF0) * 16) | ((w & 0xF00) * 256) | ((w & 0xF000) * 4096)  # lo0, hi0, lo1, hi1
        c = u.view(torch.uint8).to(torch.float32) - 8.0  # [n, gs]: little-endian bytes in element order
    else:
        b = codes.to(torch.int16)  # [n, gs / 2]: byte lo | hi << 4
        nib = ((b | (b << 4)) & 0x0F0F).view(torch.uint8)  # [n, gs]: little-endian bytes lo, hi
        c = nib.to(torch.float32) - 8.0
    return c * scales.unsqueeze(-1)


def _sum_blocks(codes: torch.Tensor, scales: torch.Tensor, bits: int, wide: bool) -> torch.Tensor:
    """Stacked codes [k, n, bpg], scales [k, n] -> fp32 [n, gs]: the dequantized inputs added onto
    zeros in index order."""
    k, n, bpg = codes.shape
    acc = torch.zeros(n, bpg * 8 // bits, dtype=torch.float32, device=codes.device)
    for i in range(k):
        acc = acc + _dequantize_blocks(codes[i], scales[i], bits, wide)
    return acc


def _dequantize_graph(codes, scales, out, *, bits, wide):
    """codes [n, bpg], scales [n] -> ``out`` [n, gs] (rounded to its dtype), in place."""
    out.copy_(_dequantize_blocks(codes, scales, bits, wide))


def _dequantize_sum_graph(codes, scales, out, *, bits, wide):
    """Stacked [k, n, *] -> their ordered fp32 sum into ``out`` [n, gs], in place."""
    out.copy_(_sum_blocks(codes, scales, bits, wide))


def _requantize_graph(codes, scales, codes_out, scales_out, seed, base, *, bits, wide, out_bits, stochastic):
    """Stacked [k, n, *] -> the fp32 sum re-quantized with ``out_bits`` in the same blocks."""
    _quantize_blocks(
        _sum_blocks(codes, scales, bits, wide), codes_out, scales_out, seed, base, bits=out_bits, stochastic=stochastic
    )


# ----------------------------------------------------------------------------------------------
# One compiled function per variant.
# ----------------------------------------------------------------------------------------------
_COMPILED: dict[tuple, Callable] = {}
_LOCK = threading.Lock()


def _variant(fn: Callable, key: tuple, **consts) -> Callable:
    """``fn`` with ``consts`` bound, compiled once per ``key``. The wrapper gets a fresh code
    object per variant: dynamo caches (and counts recompiles) per code object, so variants never
    compete for one function's recompile budget."""
    with _LOCK:
        compiled = _COMPILED.get(key)
        if compiled is None:

            def call(*args):
                return fn(*args, **consts)

            name = "_".join(str(k) for k in key).replace(".", "_")
            code = call.__code__.replace(co_name=f"{fn.__name__}_{name}")
            call = types.FunctionType(code, call.__globals__, code.co_name, None, call.__closure__)
            compiled = _COMPILED[key] = torch.compile(call, fullgraph=True)
        return compiled


def _dynamic_blocks(dim: int, *tensors: torch.Tensor) -> None:
    """Marks the block-count dimension ``dim`` (the only size that varies with the bucket) dynamic,
    so that one compiled kernel serves every size; the group size stays a constant of the kernel."""
    for t in tensors:
        torch._dynamo.maybe_mark_dynamic(t, dim)


_ZERO = torch.zeros((), dtype=torch.int64)  # read only: the kernels never write their seed / base


def _int64(value: int) -> torch.Tensor:
    """A 0-d int64 tensor: seeds and offsets are graph inputs, so new values do not recompile."""
    return _ZERO if value == 0 else torch.tensor(value, dtype=torch.int64)


def _wide(codes: torch.Tensor, bits: int) -> bool:
    """Whether INT4 codes can be read as int16 pairs: even byte counts, offset and strides."""
    return (
        bits == 4
        and codes.storage_offset() % 2 == 0
        and all(st % 2 == 0 for st in codes.stride()[:-1])
        and codes.shape[-1] % 2 == 0
    )


def quantize_fused(
    v: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bits: int, stochastic: bool, seed: int, base: int
) -> None:
    """Blocks v [n, gs] -> codes [n, bpg], scales [n] in place, bit-identical to ``quantize_ref``."""
    fn = _variant(_quantize_blocks, ("q", v.dtype, bits, v.shape[1], stochastic), bits=bits, stochastic=stochastic)
    _dynamic_blocks(0, v, codes, scales)
    fn(v, codes, scales, _int64(seed), _int64(base))


def dequantize_fused(codes: torch.Tensor, scales: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """codes [n, bpg], scales [n] -> ``out`` [n, gs] (any float dtype), in place."""
    wide = _wide(codes, bits)
    fn = _variant(_dequantize_graph, ("dq", out.dtype, bits, codes.shape[1], wide), bits=bits, wide=wide)
    _dynamic_blocks(0, codes, scales, out)
    fn(codes, scales, out)


def dequantize_sum_fused(codes: torch.Tensor, scales: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """Stacked codes [k, n, bpg], scales [k, n] -> their ordered sum into ``out`` [n, gs], in place."""
    wide = _wide(codes, bits)
    fn = _variant(
        _dequantize_sum_graph, ("ds", out.dtype, bits, codes.shape[2], codes.shape[0], wide), bits=bits, wide=wide
    )
    _dynamic_blocks(1, codes, scales)
    _dynamic_blocks(0, out)
    fn(codes, scales, out)


def requantize_fused(
    codes: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    codes_out: torch.Tensor,
    scales_out: torch.Tensor,
    out_bits: int,
    stochastic: bool,
    seed: int,
    base: int,
) -> None:
    """Stacked [k, n, *] -> the sum re-quantized with ``out_bits`` into codes_out [n, *], scales_out [n]."""
    wide = _wide(codes, bits)
    fn = _variant(
        _requantize_graph,
        ("rq", bits, codes.shape[2], out_bits, stochastic, codes.shape[0], wide),
        bits=bits,
        wide=wide,
        out_bits=out_bits,
        stochastic=stochastic,
    )
    _dynamic_blocks(1, codes, scales)
    _dynamic_blocks(0, codes_out, scales_out)
    fn(codes, scales, codes_out, scales_out, _int64(seed), _int64(base))
