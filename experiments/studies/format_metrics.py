"""What a wire format does to a tensor: one encode/decode round trip through the format's codec,
measured against the tensor itself, and how fast the CPU path does it against a memory copy.

A format is a :class:`~zeropp.comm.spec.QuantSpec` (any registered scheme: ``int``, ``fp8``,
``mx``, ``nvfp4``, ...). The tensor is sent as the collectives send a flat shard: rows of
``chunk`` elements (one row = one message to one destination, with its own scales and, for
NVFP4, its own tensor scale), the last row zero padded; every figure is taken over the real
elements only.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

from zeropp.comm.codecs import Codec, codec_for
from zeropp.comm.spec import QuantSpec
from zeropp.kernels import timing
from zeropp.runtime.plan_kinds import group_size_of


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoundTrip:
    """A format's error on one tensor (``x``: the original, ``e = decode(encode(x)) - x``)."""

    bits_per_element: float
    """Wire bits per element, scales included: ``8 * wire bytes of a row / elements in it``."""
    sqnr_db: float
    """Signal-to-quantization-noise ratio, ``10 log10(sum x^2 / sum e^2)`` (inf when exact)."""
    max_error: float
    """Largest ``|e|`` as a fraction of the tensor's largest ``|x|`` (a relative error per element
    is unbounded where x is near 0, so the error is taken relative to the tensor's range)."""
    bias: float
    """Mean error ``mean(e)`` as a fraction of the tensor's RMS: the systematic drift a format adds
    (near 0 for unbiased rounding)."""


def as_rows(x: torch.Tensor, chunk: int) -> tuple[torch.Tensor, int]:
    """Flat ``x [n]`` -> ``[rows, cols]`` fp32 with ``cols = min(chunk, n)``, zero padded; and n."""
    n = x.numel()
    cols = min(chunk, n)
    rows = math.ceil(n / cols)
    padded = torch.zeros(rows * cols, dtype=torch.float32)
    padded[:n] = x.reshape(-1)
    return padded.view(rows, cols), n


def round_trip(codec: Codec, spec: QuantSpec, x2d: torch.Tensor, group_size: int) -> torch.Tensor:
    """``x2d [rows, cols]`` through the wire and back: fp32 ``[rows, cols]``."""
    rows, cols = x2d.shape
    seed = spec.seed if spec.stochastic else None
    wire = codec.encode(x2d, spec.bits, group_size, rows=rows, seed=seed)  # uint8 [rows, B]
    return codec.dequantize(codec.unpack(wire, cols, spec.bits, group_size)).view(rows, cols)


def measure(spec: QuantSpec, x: torch.Tensor, *, chunk: int, weights: bool) -> RoundTrip:
    """The :class:`RoundTrip` figures of ``spec`` on flat ``x`` sent in rows of ``chunk``; ``weights``:
    a spec without a group size takes the weights' default group size, else the gradients'."""
    codec = codec_for(spec)
    gs = group_size_of(spec, weights=weights)
    x2d, n = as_rows(x, chunk)
    y = round_trip(codec, spec, x2d, gs).reshape(-1)[:n].double()
    ref = x.reshape(-1).double()
    err = y - ref
    noise, signal = float(err.square().sum()), float(ref.square().sum())
    absmax = float(ref.abs().max())
    rms = math.sqrt(signal / n)
    cols = x2d.shape[1]
    return RoundTrip(
        bits_per_element=8 * codec.wire_bytes(cols, spec.bits, gs) / cols,
        sqnr_db=math.inf if noise == 0 else (10 * math.log10(signal / noise) if signal > 0 else -math.inf),
        max_error=float(err.abs().max()) / absmax if absmax > 0 else float(err.abs().max()),
        bias=float(err.mean()) / rms if rms > 0 else float(err.mean()),
    )


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall seconds of ``fn`` over ``repeats`` calls after one warm-up (first-use builds)."""
    return timing.median_seconds(fn, warmup=1, iters=repeats)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Speed:
    """CPU throughput of a format's encode and decode, as shares of a memory copy moving the same
    bytes in the same run (both are memory-bound, so a copy is the ceiling)."""

    quantize_gbs: float
    """fp32 read + wire bytes written, per second of ``encode``, in GB/s."""
    dequantize_gbs: float
    """Wire bytes read + fp32 written, per second of unpack + ``dequantize``, in GB/s."""
    copy_gbs: float
    """``dst.copy_(src)`` of the fp32 tensor (read + written), in GB/s."""

    @property
    def quantize_of_copy(self) -> float:
        return self.quantize_gbs / self.copy_gbs

    @property
    def dequantize_of_copy(self) -> float:
        return self.dequantize_gbs / self.copy_gbs


def copy_gbs(x2d: torch.Tensor, repeats: int) -> float:
    """GB/s of ``dst.copy_(x2d)`` (bytes read + written)."""
    dst = torch.empty_like(x2d)
    return 2 * x2d.numel() * 4 / _median_seconds(lambda: dst.copy_(x2d), repeats) / 1e9


def speed(spec: QuantSpec, x2d: torch.Tensor, *, weights: bool, copy: float, repeats: int = 5) -> Speed:
    """Time encode and decode of ``x2d [rows, cols]`` fp32 with ``spec``'s codec (CPU); ``weights`` as
    in :func:`measure`."""
    codec = codec_for(spec)
    gs = group_size_of(spec, weights=weights)
    rows, cols = x2d.shape
    seed = spec.seed if spec.stochastic else None
    wire = codec.encode(x2d, spec.bits, gs, rows=rows, seed=seed)  # uint8 [rows, B]
    out = torch.empty_like(x2d)
    moved = x2d.numel() * 4 + wire.numel()
    tq = _median_seconds(lambda: codec.encode(x2d, spec.bits, gs, rows=rows, seed=seed), repeats)
    td = _median_seconds(lambda: codec.dequantize(codec.unpack(wire, cols, spec.bits, gs), out=out), repeats)
    return Speed(quantize_gbs=moved / tq / 1e9, dequantize_gbs=moved / td / 1e9, copy_gbs=copy)
