"""Pure-torch reference of every quantization kernel: the specification that the Triton kernels
and the CPU path (``cpu.py``, the same arithmetic tiled for speed) match bit for bit (same scales,
same codes). Written to be read, not to be fast.

All arithmetic is fp32 with the exact operation order the kernels use (see ``layout.py``):
division is IEEE round-to-nearest, rounding is ``floor(v + 0.5)`` (or ``floor(v + u)`` with
the Philox uniform ``u`` of :func:`philox_uniform`, which defines the stochastic stream, for
stochastic rounding), and a k-way sum adds the dequantized inputs in index order 0..k-1.
"""

from __future__ import annotations

import torch

from .layout import (
    QuantizedTensor,
    check_dims,
    check_float_dtype,
    check_quantize_args,
    check_requantize_args,
    num_groups,
    output_buffer,
    output_rows,
    qmax,
    split_rows,
)

# ----------------------------------------------------------------------------------------------
# Triton's Philox4x32-10 and uint -> uniform float conversion (triton.language.random), in torch.
# ----------------------------------------------------------------------------------------------
_M32 = 0xFFFFFFFF
_PHILOX_KEY_A = 0x9E3779B9
_PHILOX_KEY_B = 0xBB67AE85
_PHILOX_ROUND_A = 0xD2511F53
_PHILOX_ROUND_B = 0xCD9E8D57
_UNIFORM_SCALE = 4.6566127342e-10  # 2**-31, as Triton writes it


def _umulhi32(a: int, b: torch.Tensor) -> torch.Tensor:
    """High 32 bits of the 64-bit product of a uint32 constant and uint32 values (held in int64)."""
    b_hi, b_lo = b >> 16, b & 0xFFFF
    return (a * b_hi + ((a * b_lo) >> 16)) >> 16


def philox4x32_10(
    seed: int | torch.Tensor, counters: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``tl.randint4x(seed, counters)`` for int64 ``counters``: the four output words of
    Philox4x32-10 on the counter block ``(lo, hi, 0, 0)`` of each counter under the key
    ``(seed lo, seed hi)``, as uint32 values held in int64, bit-identical."""
    c0 = counters & _M32
    c1 = (counters >> 32) & _M32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(10):
        _c0, _c2 = c0, c2
        c0 = _umulhi32(_PHILOX_ROUND_B, _c2) ^ c1 ^ k0
        c2 = _umulhi32(_PHILOX_ROUND_A, _c0) ^ c3 ^ k1
        c1 = (_PHILOX_ROUND_B * _c2) & _M32
        c3 = (_PHILOX_ROUND_A * _c0) & _M32
        k0 = (k0 + _PHILOX_KEY_A) & _M32
        k1 = (k1 + _PHILOX_KEY_B) & _M32
    return c0, c1, c2, c3


def uint32_to_uniform(w: torch.Tensor) -> torch.Tensor:
    """Triton's ``uint_to_uniform_float`` of uint32 words held in int64: the word read as int32,
    ``~x`` for negatives, times ``4.6566127342e-10`` in fp32 (a uniform in [0, 1))."""
    x = torch.where(w >= 2**31, w - 2**32, w)  # bitcast uint32 -> int32
    x = torch.where(x < 0, -x - 1, x).to(torch.int32)  # ~x for negatives
    return x.to(torch.float32) * torch.tensor(_UNIFORM_SCALE, dtype=torch.float32)


def philox_uniform(seed: int | torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The uniforms in [0, 1) (fp32) that stochastic rounding adds at int64 ``offsets``: the
    stream of every stochastic codec (INT and the float formats), defined here once.

    The rule: the element at padded-layout offset ``o`` (``row * padded_cols + col``) takes output
    word ``o % 4`` of Philox4x32-10 (:func:`philox4x32_10`, Triton's ``tl.randint4x``) at counter
    ``o // 4`` under key ``seed``, converted as ``tl.rand`` converts (:func:`uint32_to_uniform`).
    Four consecutive offsets share one Philox evaluation, so an implementation that draws a run
    of elements needs one evaluation per four of them (the native CPU kernels, ``cpu_common.h``);
    the Triton tiles (``_triton.stochastic_uniform``) select each element's word.
    """
    offsets = offsets.to(torch.int64)  # as uint64 (the native kernels'): a negative o means o + 2**64
    c0, c1, c2, c3 = philox4x32_10(seed, (offsets >> 2) & (2**62 - 1))
    lane = offsets & 3
    w = torch.where(lane == 0, c0, torch.where(lane == 1, c1, torch.where(lane == 2, c2, c3)))
    return uint32_to_uniform(w)


# ----------------------------------------------------------------------------------------------
# Block quantization of fp32 values laid out as [rows, groups, group_size].
# ----------------------------------------------------------------------------------------------
def _pad_rows(x2d: torch.Tensor, group_size: int) -> torch.Tensor:
    """[rows, cols] any float -> [rows, groups, group_size] fp32, zero padded."""
    rows, cols = x2d.shape
    g = num_groups(cols, group_size)
    out = torch.zeros(rows, g * group_size, dtype=torch.float32, device=x2d.device)
    out[:, :cols] = x2d
    return out.view(rows, g, group_size)


def _quantize_blocks(v: torch.Tensor, bits: int, stochastic: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """v: [rows, groups, group_size] fp32 -> (codes int32 same shape, scales [rows, groups] fp32)."""
    q = qmax(bits)
    finite = torch.isfinite(v).all(dim=-1)  # [rows, groups]
    absmax = torch.where(torch.isfinite(v), v.abs(), torch.zeros_like(v)).amax(dim=-1)
    scale = absmax / torch.tensor(float(q), dtype=torch.float32)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
    t = v / safe
    if stochastic:
        rows, g, gs = v.shape
        offs = torch.arange(rows * g * gs, dtype=torch.int64, device=v.device).view(rows, g, gs)
        t = t + philox_uniform(seed, offs.cpu()).to(v.device)
    else:
        t = t + 0.5
    codes = torch.floor(t).clamp_(-q, q)
    ok = (finite & (scale > 0)).unsqueeze(-1)
    codes = torch.where(ok, codes, torch.zeros_like(codes)).to(torch.int32)
    scale = torch.where(finite, scale, torch.full_like(scale, float("nan")))
    return codes, scale


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 codes [rows, padded_cols] -> stored codes [rows, row_bytes]."""
    if bits == 8:
        return codes.to(torch.int8)
    nib = (codes + 8).to(torch.uint8)
    return nib[:, 0::2] | (nib[:, 1::2] << 4)


def _unpack(stored: torch.Tensor, bits: int) -> torch.Tensor:
    """stored codes [..., row_bytes] -> fp32 codes [..., padded_cols]."""
    if bits == 8:
        return stored.to(torch.float32)
    lo = (stored & 0xF).to(torch.int32) - 8
    hi = (stored >> 4).to(torch.int32) - 8
    return torch.stack([lo, hi], dim=-1).flatten(-2).to(torch.float32)


def _dequantize_fp32(q: QuantizedTensor) -> torch.Tensor:
    """codes/scales [..., rows, *] -> fp32 [..., rows, groups, group_size] (padded)."""
    c = _unpack(q.codes, q.bits)
    c = c.view(*c.shape[:-1], num_groups(q.cols, q.group_size), q.group_size)
    return c * q.scales.unsqueeze(-1)


def _to_quantized(
    v: torch.Tensor, cols: int, bits: int, group_size: int, stochastic: bool, seed: int
) -> QuantizedTensor:
    codes, scales = _quantize_blocks(v, bits, stochastic, seed)
    rows = v.shape[0]
    return QuantizedTensor(_pack(codes.view(rows, -1), bits), scales, cols, bits, group_size)


def _write_out(full: torch.Tensor, cols: int, out: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """[rows, groups, group_size] fp32 -> [rows, cols] in ``dtype``, into ``out`` if given."""
    rows = full.shape[0]
    dst = output_buffer(out, rows, cols, dtype, full.device)
    dst.view(rows, cols).copy_(full.reshape(rows, -1)[:, :cols])
    return dst


def _sum_fp32(q: QuantizedTensor) -> torch.Tensor:
    """Stacked [k, rows, *] -> fp32 [rows, groups, group_size]: the dequantized inputs added in
    index order 0..k-1 onto zeros (k = 0 sums to zeros), as the kernels accumulate."""
    deq = _dequantize_fp32(q)
    acc = deq.new_zeros(deq.shape[1:])
    for i in range(deq.shape[0]):
        acc = acc + deq[i]
    return acc


# ----------------------------------------------------------------------------------------------
# Public reference functions (same signatures as the dispatching ones in kernels/__init__.py).
# ----------------------------------------------------------------------------------------------
def quantize_ref(
    x: torch.Tensor, bits: int, group_size: int, *, rows: int = 1, stochastic: bool = False, seed: int = 0
) -> QuantizedTensor:
    """x (any shape, numel divisible by ``rows``) -> QuantizedTensor of ``rows`` rows."""
    cols, seed = check_quantize_args(x, bits, group_size, rows, seed)
    v = _pad_rows(x.reshape(rows, cols), group_size)
    return _to_quantized(v, cols, bits, group_size, stochastic, seed)


def dequantize_ref(
    q: QuantizedTensor, *, out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """QuantizedTensor -> [rows, cols] in ``dtype`` (or written into ``out``, any shape of that numel)."""
    check_dims(q, False, "dequantize")
    return _write_out(_dequantize_fp32(q), q.cols, out, dtype)


def dequantize_sum_ref(
    q: QuantizedTensor, *, out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Stacked QuantizedTensor [k, rows, *] -> sum over k, [rows, cols], accumulated in fp32."""
    check_dims(q, True, "dequantize_sum")
    return _write_out(_sum_fp32(q), q.cols, out, dtype)


def dequantize_sum_requantize_ref(
    q: QuantizedTensor, bits: int, group_size: int, *, stochastic: bool = False, seed: int = 0
) -> QuantizedTensor:
    """Stacked QuantizedTensor [k, rows, *] -> the fp32 sum over k, quantized again with
    ``bits``/``group_size`` (the qgZ intra-node hop). ``group_size`` must equal the input's: the
    fused kernel re-quantizes each block where it was summed."""
    _, _, seed = check_requantize_args(q, bits, group_size, seed)
    # Padding positions sum to exactly 0, so re-quantizing the padded blocks is the same as
    # re-quantizing the unpadded row.
    return _to_quantized(_sum_fp32(q), q.cols, bits, group_size, stochastic, seed)


# ----------------------------------------------------------------------------------------------
# Blockwise Walsh-Hadamard transform (SDP4Bit's rotation before quantizing).
# ----------------------------------------------------------------------------------------------
MAX_HADAMARD_BLOCK = 1 << 14
"""Largest rotation block: one block is transformed in registers by one Triton program."""


def rotated_cols(cols: int, block: int) -> int:
    """Columns of a rotated row: ``cols`` rounded up to whole blocks (the last one zero padded).
    When ``block`` divides the quantization group size this never adds a quantization group, so
    a rotated row takes exactly the bytes of the plain one on the wire."""
    return -(-cols // block) * block


def check_hadamard_block(block: int) -> None:
    """A rotation block is a power of two in [2, MAX_HADAMARD_BLOCK]."""
    is_int = isinstance(block, int) and not isinstance(block, bool)
    if not is_int or block < 2 or block & (block - 1) or block > MAX_HADAMARD_BLOCK:
        raise ValueError(
            f"Hadamard block={block!r} must be a power of two between 2 and {MAX_HADAMARD_BLOCK} "
            f"(the Walsh-Hadamard butterflies halve it log2(block) times); e.g. 32, 64 or 128"
        )


def check_hadamard_args(x: torch.Tensor, block: int, rows: int, out_cols: int | None) -> tuple[int, int, int]:
    """Checks shared by every implementation of ``hadamard``; returns ``(cols, padded, out_cols)``."""
    check_hadamard_block(block)
    check_float_dtype(x.dtype, "input")
    cols = split_rows(x.numel(), rows)
    padded = rotated_cols(cols, block)
    if out_cols is None:
        out_cols = padded
    elif isinstance(out_cols, bool) or not isinstance(out_cols, int) or not 0 <= out_cols <= padded:
        raise ValueError(
            f"out_cols={out_cols!r} must be an int in [0, {padded}] (rows of {cols} elements padded to "
            f"whole blocks of {block}); pass out_cols=None to keep the whole rotated row"
        )
    return cols, padded, out_cols


def hadamard_scale(block: int) -> float:
    """``1 / sqrt(block)`` rounded once to fp32 (exact for powers of 4), as a Python float that
    is exactly that fp32 value, so the Triton kernel and the reference multiply by the same number."""
    return float(torch.tensor(block**-0.5, dtype=torch.float32))


def hadamard_ref(
    x: torch.Tensor,
    block: int,
    *,
    rows: int = 1,
    out_cols: int | None = None,
    out: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Normalised blockwise Walsh-Hadamard transform of ``rows`` rows: the specification.

    Each row of ``cols = numel / rows`` elements is zero padded to ``rotated_cols(cols, block)``
    (a whole number of blocks: the last, partial block is completed with zeros *before* the
    transform, so its rotated values fill the whole block), and every block ``v`` of ``block``
    (a power of two) elements becomes ``H v * s`` with ``H`` the Sylvester Hadamard matrix and
    ``s = hadamard_scale(block)``. ``H / sqrt(block)`` is symmetric and orthogonal, so the same
    call undoes it: transform ``[rows, rotated_cols]`` back and keep ``out_cols = cols``.

    Arithmetic (what the Triton kernel repeats bit for bit): fp32 throughout; stage
    ``s = 0 .. log2(block) - 1`` pairs the elements ``i`` and ``i + h`` (``h = 2**s``, ``i`` with
    bit ``s`` clear) and replaces them with ``(a + b, a - b)``; after the last stage each element
    is multiplied once by ``s``. The result keeps the first ``out_cols`` columns (default: all
    ``rotated_cols``), is rounded once to ``dtype`` (or ``out``'s dtype) and written to a new
    ``[rows, out_cols]`` tensor or into ``out`` (contiguous, or a row-strided ``[rows, out_cols]``).
    """
    cols, padded, out_cols = check_hadamard_args(x, block, rows, out_cols)
    v = torch.empty(rows, padded, dtype=torch.float32, device=x.device)  # [rows, padded]
    v[:, :cols] = x.reshape(rows, cols)
    v[:, cols:] = 0.0  # the last block's zero padding
    w = torch.empty_like(v)
    h = 1
    while h < block:
        a = v.view(rows, padded // (2 * h), 2, h)  # [rows, pairs of half-blocks, 2, h]
        b = w.view(rows, padded // (2 * h), 2, h)
        torch.add(a[:, :, 0], a[:, :, 1], out=b[:, :, 0])
        torch.sub(a[:, :, 0], a[:, :, 1], out=b[:, :, 1])
        v, w = w, v
        h *= 2
    v.mul_(torch.tensor(hadamard_scale(block), dtype=torch.float32))
    dst, _ = output_rows(out, rows, out_cols, dtype, x.device)
    target = dst if dst.dim() == 2 and tuple(dst.shape) == (rows, out_cols) else dst.view(rows, out_cols)
    target.copy_(v[:, :out_cols])
    return dst
