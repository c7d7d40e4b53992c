"""zeropp.kernels: the math of ZeRO++ (block quantization, dequantization, fused reductions,
the blockwise Hadamard rotation).

This floor knows nothing of process groups. Installed, it is importable only as
``zeropp.kernels`` (never as a top-level ``kernels``).
"""

from .hadamard import MAX_HADAMARD_BLOCK, hadamard, rotated_cols
from .layout import (
    DEFAULT_GRAD_GROUP_SIZE,
    DEFAULT_WEIGHT_GROUP_SIZE,
    SUPPORTED_BITS,
    QuantizedTensor,
    num_groups,
    quantized_nbytes,
    row_bytes,
)
from .quantize import dequantize, quantize
from .reduce import dequantize_sum, dequantize_sum_requantize

__all__ = [
    "DEFAULT_GRAD_GROUP_SIZE",
    "DEFAULT_WEIGHT_GROUP_SIZE",
    "MAX_HADAMARD_BLOCK",
    "SUPPORTED_BITS",
    "QuantizedTensor",
    "dequantize",
    "dequantize_sum",
    "dequantize_sum_requantize",
    "hadamard",
    "num_groups",
    "quantize",
    "quantized_nbytes",
    "rotated_cols",
    "row_bytes",
]
