"""The CPU path: the reference's arithmetic, bit-identical to ``reference.py``, three ways.

CPU tensors of every size take the native kernels of ``cpu_native.py`` (hand-written C++ built
at first use: one pass per block, the reference's operations in its order; why it is exact and
fast is said there). Where they cannot be built or loaded (no C++ compiler; a warning says so
once), tensors of at least ``cpu_fused.FUSED_MIN_ELEMS`` elements take the compiled single-pass
kernels of ``cpu_fused.py`` (the reference's formulation under ``torch.compile``) on their whole
blocks, and smaller tensors, the partial last block of each row, and every tensor once that
compilation too has failed take the tiles of ``cpu_tiles.py``, which need no compiler. Measured on one thread
of the 2-core dev machine (``docs/benchmarks.md``): the native kernels are about 4-6x faster than
the tiles at bucket sizes for quantize and dequantize; the compiled kernels 2-3x.

Fresh outputs (codes and scales of ``quantize``, a dequantized tensor without ``out=``) are
allocated by ``cpu_native.empty``, which asks for transparent huge pages for large buffers: first
writes into new memory fault in each page, and on small pages that costs more than the
quantization itself at 64 MiB.

The tiled path and why its tiles are bit-identical to the reference: ``cpu_tiles.py``.
"""

from __future__ import annotations

import warnings

import torch

from . import cpu_fused, cpu_native, cpu_tiles
from .cpu_tiles import TILE_ELEMS as TILE_ELEMS  # re-exported: the tiles' size
from .layout import (
    QuantizedTensor,
    check_dims,
    check_float_dtype,
    check_quantize_args,
    check_quantized_out,
    check_requantize_args,
    codes_dtype,
    num_groups,
    output_buffer,
    row_bytes,
)

# ----------------------------------------------------------------------------------------------
# Dispatch between the native kernels, the compiled single-pass path (cpu_fused.py) and the tiles.
# ----------------------------------------------------------------------------------------------
_fused_failed: str | None = None
"""Why the compiled path was switched off in this process (None while it works)."""

_native_warned = False


def native_enabled() -> bool:
    """Whether CPU tensors take the native kernels (``cpu_native.py``; built at the first call).
    When they cannot be built or loaded, warns once and returns False: the compiled / tiled paths
    below then serve, bit-identical but slower."""
    global _native_warned
    if cpu_native.available():
        return True
    if cpu_native.FAILED is not None and not _native_warned:
        _native_warned = True
        warnings.warn(
            f"zeropp.kernels: the native CPU quantization kernels are unavailable ({cpu_native.FAILED}); "
            "using the slower compiled / tiled path for the rest of this process",
            RuntimeWarning,
            stacklevel=3,
        )
    return False


def _last_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dimension is contiguous (the native kernels take any other
    strides), else a contiguous copy."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _output(out: torch.Tensor | None, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``output_buffer`` with a fresh output allocated as :func:`cpu_native.empty` does."""
    if out is None:
        check_float_dtype(dtype, "output")
        return cpu_native.empty(rows, cols, dtype=dtype)
    return output_buffer(out, rows, cols, dtype, device)


def _quantized_buffers(rows: int, cols: int, bits: int, gs: int, out: QuantizedTensor | None, device: torch.device):
    """``(codes [rows, row_bytes], scales [rows, g])``: ``out``'s (checked), or new ones."""
    if out is not None:
        check_quantized_out(out, rows, cols, bits, gs, device)
        return out.codes, out.scales
    return (
        cpu_native.empty(rows, row_bytes(cols, bits, gs), dtype=codes_dtype(bits)),
        cpu_native.empty(rows, num_groups(cols, gs), dtype=torch.float32),
    )


def fused_enabled(numel: int, dequantize: bool = False) -> bool:
    """Whether a tensor of ``numel`` elements takes the compiled path (see ``cpu_fused.py``);
    ``dequantize``: for a plain dequantize, which has its own, higher threshold."""
    least = max(cpu_fused.FUSED_MIN_ELEMS, cpu_fused.DEQUANTIZE_MIN_ELEMS if dequantize else 0)
    return cpu_fused.AVAILABLE and _fused_failed is None and numel >= least


def _run_fused(fn, *args) -> bool:
    """Runs a compiled kernel; on a compilation failure (no C++ compiler, say) warns once, turns the
    compiled path off for this process and returns False so the caller takes the tiled path."""
    global _fused_failed
    try:
        fn(*args)
        return True
    except Exception as err:
        _fused_failed = f"{type(err).__name__}: {err}"
        warnings.warn(
            f"zeropp.kernels: the compiled CPU quantization path failed ({_fused_failed}); "
            "using the slower tiled path for the rest of this process",
            RuntimeWarning,
            stacklevel=3,
        )
        return False


MAX_ROW_CALLS = 64
"""Rows with a partial last block take one compiled call each; beyond this many rows the tiled
path is used instead (reduce-scatter inputs have one row per rank, far fewer)."""


def _row_blocks(rows: int, g: int, full: int) -> list[tuple[int | None, int]]:
    """``(r, n)`` units the compiled kernels take as flat ``[n, *]`` blocks: all rows at once when
    every row is whole blocks (``r`` None), else the ``full`` whole blocks of each row ``r`` (none
    at all past ``MAX_ROW_CALLS`` rows: the callers then fall back to the tiles)."""
    if full == g:
        return [(None, rows * g)]
    return [(r, full) for r in range(rows)] if rows <= MAX_ROW_CALLS else []


def _tail(q: QuantizedTensor, full: int) -> QuantizedTensor:
    """The partial last block of each row of ``q`` (stacked or not) as its own QuantizedTensor."""
    bpg = q.group_size * q.bits // 8
    return QuantizedTensor(
        q.codes[..., full * bpg :], q.scales[..., full:], q.cols - full * q.group_size, q.bits, q.group_size
    )


def _fused_write(q: QuantizedTensor, stacked: bool, dst: torch.Tensor) -> bool:
    """Dequantized (summed) whole blocks of ``q`` into ``dst`` [rows, cols] by the compiled kernels.
    Returns False (nothing written) when the compiled path is off; the partial last blocks are left."""
    gs, bits, cols = q.group_size, q.bits, q.cols
    codes = q.codes if stacked else q.codes.unsqueeze(0)  # [k, rows, rb]
    scales = q.scales if stacked else q.scales.unsqueeze(0)  # [k, rows, g]
    k, rows, g = scales.shape
    full, bpg = cols // gs, gs * bits // 8
    units = _row_blocks(rows, g, full)
    if not units:
        return False
    for r, n in units:
        if r is None:
            c, s, o = codes.reshape(k, n, bpg), scales.reshape(k, n), dst.view(n, gs)
        else:
            c = codes[:, r, : n * bpg].reshape(k, n, bpg).contiguous()
            s, o = scales[:, r, :n].contiguous(), dst[r, : n * gs].view(n, gs)
        ok = (
            _run_fused(cpu_fused.dequantize_sum_fused, c, s, bits, o)
            if stacked
            else _run_fused(cpu_fused.dequantize_fused, c[0], s[0], bits, o)
        )
        if not ok:
            return False
    if g > full:  # the partial last blocks, tiled, through a small buffer (their columns are strided)
        tail = _tail(q, full)
        buf = torch.empty(rows, tail.cols, dtype=dst.dtype)
        cpu_tiles.write_tiles(tail, stacked, buf)
        dst[:, full * gs :].copy_(buf)
    return True


def _dequantize_into(q: QuantizedTensor, stacked: bool, out: torch.Tensor) -> torch.Tensor:
    if native_enabled():  # codes [k, rows, row_bytes] / [rows, row_bytes], scales [k, rows, g] / [rows, g]
        cpu_native.dequantize_into(
            _last_contiguous(q.codes), _last_contiguous(q.scales), q.bits, q.group_size, q.cols, stacked, out
        )
        return out
    dst = out.view(q.rows, q.cols)
    k = q.codes.shape[0] if stacked else 1
    if k and q.cols >= q.group_size and fused_enabled(q.rows * q.cols, not stacked) and _fused_write(q, stacked, dst):
        return out
    return cpu_tiles.write_tiles(q, stacked, out)


def dequantize_cpu(
    q: QuantizedTensor, *, out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``dequantize_ref`` for CPU tensors, bit for bit (compiled or tiled, see the module docstring)."""
    _, rows = check_dims(q, False, "dequantize")
    return _dequantize_into(q, False, _output(out, rows, q.cols, dtype, q.codes.device))


def dequantize_sum_cpu(
    q: QuantizedTensor, *, out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``dequantize_sum_ref`` for CPU tensors, bit for bit (no k full-precision copies)."""
    _, rows = check_dims(q, True, "dequantize_sum")
    return _dequantize_into(q, True, _output(out, rows, q.cols, dtype, q.codes.device))


def _fused_quantize(
    x2: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bits: int, gs: int, stochastic: bool, seed: int
) -> bool:
    """Whole blocks of x2 [rows, cols] into codes / scales by the compiled kernel (False: path off)."""
    rows, cols = x2.shape
    g, full, bpg = scales.shape[1], cols // gs, gs * bits // 8
    units = _row_blocks(rows, g, full)
    if not units:
        return False
    x2 = x2.contiguous()
    for r, n in units:
        if r is None:
            v, c, s, base = x2.view(n, gs), codes.view(n, bpg), scales.view(n), 0
        else:
            v, c, s, base = x2[r, : n * gs].view(n, gs), codes[r, : n * bpg].view(n, bpg), scales[r, :n], r * g * gs
        if not _run_fused(cpu_fused.quantize_fused, v, c, s, bits, stochastic, seed, base):
            return False
    return True


def quantize_cpu(
    x: torch.Tensor,
    bits: int,
    group_size: int,
    *,
    rows: int = 1,
    stochastic: bool = False,
    seed: int = 0,
    out: QuantizedTensor | None = None,
) -> QuantizedTensor:
    """``quantize_ref`` for CPU tensors, bit for bit, several times faster (see the module docstring).
    ``out``: a QuantizedTensor of the result's layout (contiguous) written in place and returned."""
    cols, seed = check_quantize_args(x, bits, group_size, rows, seed)
    if x.device.type != "cpu":
        raise ValueError(f"quantize_cpu takes CPU tensors, got one on {x.device}")
    gs = group_size
    codes, scales = _quantized_buffers(rows, cols, bits, gs, out, x.device)  # [rows, row_bytes], [rows, groups]
    x2 = x.reshape(rows, cols)  # a view when x is contiguous
    if native_enabled():
        cpu_native.quantize_into(_last_contiguous(x2), bits, gs, stochastic, seed, codes, scales)
        return out if out is not None else QuantizedTensor.unchecked(codes, scales, cols, bits, gs)
    g = num_groups(cols, gs)
    bpg = gs * bits // 8  # code bytes per block
    full = cols // gs  # complete blocks per row, quantized straight from the input
    fused = full and fused_enabled(x.numel()) and _fused_quantize(x2, codes, scales, bits, gs, stochastic, seed)
    if full and not fused:
        v = x2[:, : full * gs].unflatten(1, (full, gs))  # [rows, full, gs] view
        cpu_tiles.quantize_blocks(
            v, codes[:, : full * bpg].unflatten(1, (full, bpg)), scales[:, :full], bits, stochastic, seed, 0, g
        )
    if g > full:  # the partial last block of each row, zero padded
        tail = torch.zeros(rows, 1, gs, dtype=torch.float32)
        tail[:, 0, : cols - full * gs] = x2[:, full * gs :]
        cpu_tiles.quantize_blocks(
            tail, codes[:, full * bpg :].unsqueeze(1), scales[:, full:], bits, stochastic, seed, full, g
        )
    return out if out is not None else QuantizedTensor(codes, scales, cols, bits, gs)


def _fused_requantize(
    q: QuantizedTensor, codes: torch.Tensor, scales: torch.Tensor, bits: int, stochastic: bool, seed: int
) -> bool:
    """The whole blocks' sums of stacked ``q`` re-quantized by the compiled kernel (False: path off)."""
    k, rows, g = q.scales.shape
    gs, full = q.group_size, q.cols // q.group_size
    ibpg, obpg = gs * q.bits // 8, gs * bits // 8
    units = _row_blocks(rows, g, full)
    if not units:
        return False
    for r, n in units:
        if r is None:
            c, s, co, so, base = (
                q.codes.reshape(k, n, ibpg),
                q.scales.reshape(k, n),
                codes.view(n, obpg),
                scales.view(n),
                0,
            )
        else:
            c = q.codes[:, r, : n * ibpg].reshape(k, n, ibpg).contiguous()
            s, co, so = q.scales[:, r, :n].contiguous(), codes[r, : n * obpg].view(n, obpg), scales[r, :n]
            base = r * g * gs
        if not _run_fused(cpu_fused.requantize_fused, c, s, q.bits, co, so, bits, stochastic, seed, base):
            return False
    return True


def dequantize_sum_requantize_cpu(
    q: QuantizedTensor,
    bits: int,
    group_size: int,
    *,
    stochastic: bool = False,
    seed: int = 0,
    out: QuantizedTensor | None = None,
) -> QuantizedTensor:
    """``dequantize_sum_requantize_ref`` for CPU tensors, bit for bit: each block's fp32 sum (padding
    sums to 0, or NaN in a non-finite block) is re-quantized where it lies, as the fused kernel
    does, so the full-precision sum never exists as a whole. ``out`` as for :func:`quantize_cpu`."""
    k, rows, seed = check_requantize_args(q, bits, group_size, seed)
    cols, g = q.cols, num_groups(q.cols, group_size)
    codes, scales = _quantized_buffers(rows, cols, bits, group_size, out, q.codes.device)
    if native_enabled():
        cpu_native.requantize_into(
            _last_contiguous(q.codes),
            _last_contiguous(q.scales),
            q.bits,
            group_size,
            cols,
            bits,
            stochastic,
            seed,
            codes,
            scales,
        )
        return out if out is not None else QuantizedTensor.unchecked(codes, scales, cols, bits, group_size)
    full = cols // group_size
    if k and full and fused_enabled(rows * q.cols) and _fused_requantize(q, codes, scales, bits, stochastic, seed):
        if g == full:
            return out if out is not None else QuantizedTensor(codes, scales, cols, bits, group_size)
        first, q = full, _tail(q, full)  # the partial last blocks go through the tiles below
    else:
        first = 0
    G = g - first  # blocks per row left for the tiles
    codes3 = codes.view(rows, g, group_size * bits // 8)[:, first:]  # [rows, G, code bytes per block]
    buf = cpu_tiles.scratch(rows, G, group_size)
    for r0, r1, g0, g1, acc in cpu_tiles.summed_tiles(q, True):
        offs = cpu_tiles.offsets(r0, r1, first + g0, first + g1, g, group_size) if stochastic else None
        cpu_tiles.quantize_tile(
            acc, codes3[r0:r1, g0:g1], scales[r0:r1, first + g0 : first + g1], buf, bits, stochastic, seed, offs
        )
    return out if out is not None else QuantizedTensor(codes, scales, cols, bits, group_size)
