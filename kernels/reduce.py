"""Reductions over k stacked quantized tensors: dequantize-sum (the last qgZ hop) and the fused
dequantize-sum-requantize of the qgZ intra-node hop (no k full-precision copies materialised).
"""

from __future__ import annotations

import torch

from .layout import QuantizedTensor
from .quantize import _use_triton
from .reference import dequantize_sum_ref, dequantize_sum_requantize_ref


def dequantize_sum(
    q: QuantizedTensor,
    *,
    out: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    impl: str | None = None,
) -> torch.Tensor:
    """Stacked ``[k, rows, *]`` -> fp32-accumulated sum over k as ``[rows, cols]`` (or into ``out``)."""
    if _use_triton(q.codes, impl):
        raise NotImplementedError("Triton dequantize_sum launcher: see issue 2")
    return dequantize_sum_ref(q, out=out, dtype=dtype)


def dequantize_sum_requantize(
    q: QuantizedTensor,
    bits: int,
    group_size: int | None = None,
    *,
    stochastic: bool = False,
    seed: int = 0,
    impl: str | None = None,
) -> QuantizedTensor:
    """Stacked ``[k, rows, *]`` -> their sum re-quantized to ``bits`` (same group size)."""
    group_size = q.group_size if group_size is None else group_size
    if _use_triton(q.codes, impl):
        raise NotImplementedError("Triton dequantize_sum_requantize launcher: see issue 2")
    return dequantize_sum_requantize_ref(q, bits, group_size, stochastic=stochastic, seed=seed)
