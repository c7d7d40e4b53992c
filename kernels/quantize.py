"""Block-wise symmetric quantize / dequantize (qwZ weights, qgZ gradient chunks).

CUDA tensors take the Triton kernels; CPU tensors take the torch reference in ``reference.py``.
``impl="triton"`` forces the kernels (tests do this on CPU under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch

from .layout import DEFAULT_WEIGHT_GROUP_SIZE, QuantizedTensor
from .reference import dequantize_ref, quantize_ref


def _use_triton(t: torch.Tensor, impl: str | None) -> bool:
    if impl not in (None, "triton", "torch"):
        raise ValueError(f"impl must be None (auto), 'triton' or 'torch', got {impl!r}")
    return impl == "triton" or (impl is None and t.is_cuda)


def quantize(
    x: torch.Tensor,
    bits: int = 8,
    group_size: int | None = None,
    *,
    rows: int = 1,
    stochastic: bool = False,
    seed: int = 0,
    impl: str | None = None,
) -> QuantizedTensor:
    """Quantize ``x`` (fp32/bf16/fp16, any shape, numel divisible by ``rows``) as ``rows`` rows."""
    group_size = DEFAULT_WEIGHT_GROUP_SIZE if group_size is None else group_size
    if _use_triton(x, impl):
        raise NotImplementedError("Triton quantize launcher: see issue 2")
    return quantize_ref(x, bits, group_size, rows=rows, stochastic=stochastic, seed=seed)


def dequantize(
    q: QuantizedTensor,
    *,
    out: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    impl: str | None = None,
) -> torch.Tensor:
    """QuantizedTensor -> ``[rows, cols]`` in ``dtype``, or written into ``out`` (contiguous,
    ``rows*cols`` elements, its dtype wins)."""
    if _use_triton(q.codes, impl):
        raise NotImplementedError("Triton dequantize launcher: see issue 2")
    return dequantize_ref(q, out=out, dtype=dtype)
