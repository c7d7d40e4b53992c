"""The reference composition of Hadamard-rotated quantization, from the kernels' torch reference
functions in the documented order: rotate (``hadamard_ref``, rows zero padded to whole blocks),
quantize, dequantize, rotate back keeping the original length. ``had`` builds the rotated spec."""

from __future__ import annotations

import torch

from zeropp.comm.spec import QuantSpec
from zeropp.kernels import QuantizedTensor
from zeropp.kernels.reference import dequantize_ref, hadamard_ref, quantize_ref


def had(bits: int, gs, block=None, **kw) -> QuantSpec:
    """A Hadamard-rotated spec of ``bits`` and group size ``gs`` (block ``block``, or the default)."""
    return QuantSpec(bits=bits, group_size=gs, rotation="hadamard", hadamard_block=block, **kw)


def rot(x: torch.Tensor, b: int, rows: int = 1) -> torch.Tensor:
    """Rotated fp32 rows [rows, rotated_cols]."""
    return hadamard_ref(x, b, rows=rows)


def unrot(v: torch.Tensor, b: int, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rotated [rows, rotated_cols] -> [rows, cols] in ``dtype``."""
    return hadamard_ref(v, b, rows=v.shape[0], out_cols=cols, dtype=dtype)


def q_rot(x: torch.Tensor, b: int, bits: int, gs: int, rows: int = 1, seed=None) -> QuantizedTensor:
    """Reference codes of ``x`` rotated: stochastic with ``seed`` when one is given."""
    kw = {} if seed is None else dict(stochastic=True, seed=seed)
    return quantize_ref(rot(x, b, rows), bits, gs, rows=rows, **kw)


def round_trip(
    x: torch.Tensor, b: int, bits: int, gs: int, rows: int = 1, seed=None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Reference round trip of ``x`` ([rows * cols]): rotate, quantize, dequantize, rotate back."""
    cols = x.numel() // rows
    return unrot(dequantize_ref(q_rot(x, b, bits, gs, rows, seed)), b, cols, dtype)
