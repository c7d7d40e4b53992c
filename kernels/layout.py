"""The quantized-tensor format shared by every kernel, its torch reference and the collectives.

A tensor is quantized as ``rows`` independent rows of ``cols`` elements each (a 1-D shard is one
row; a reduce-scatter input is ``world`` rows, one per destination chunk). Each row is cut into
``groups = ceil(cols / group_size)`` blocks; the last block is padded with zeros, so no element
count ever has to be a multiple of 8 or of the group size. Each block gets one fp32 scale.

Symmetric quantization, ``qmax = 2**(bits-1) - 1`` (127 for INT8, 7 for INT4)::

    scale = absmax(block) / qmax                       (IEEE division, round to nearest)
    code  = clamp(floor(x / scale + 0.5), -qmax, qmax)  (or floor(x / scale + u), u ~ U[0,1))
    x'    = code * scale

Special blocks, so that a result is never silently wrong:
- all-zero block: scale 0, codes 0, dequantizes to exact zeros (never NaN);
- a block holding NaN or +-Inf: scale NaN, codes 0, dequantizes to NaN everywhere, so that
  overflow checks downstream (fp16 loss scaling, gradient-norm checks) still see it.

Storage per row: INT8 codes are ``int8`` (one per element); INT4 codes are ``uint8``, two per
byte, element ``2i`` in the low nibble and ``2i+1`` in the high nibble, each stored as
``code + 8`` (so 1..15; the padding code 0 is stored as 8).
"""

from __future__ import annotations

import dataclasses
import math
import operator

import torch

SUPPORTED_BITS = (4, 8)
"""Bit widths the kernels implement."""

DEFAULT_WEIGHT_GROUP_SIZE = 512
"""Default block size for weights (qwZ): INT8 scales cost 4 bytes per 512 = 0.8% extra traffic."""

DEFAULT_GRAD_GROUP_SIZE = 128
"""Default block size for gradients (qgZ): small blocks keep INT4 error local (SDP4Bit uses 128)."""

MAX_GROUP_SIZE = 1 << 14
"""Largest block (elements) every implementation takes. One block is one Triton program's tile,
held in registers: at 16384 elements and 8 warps that is 64 fp32 values per thread (with the
stochastic path's uniforms beside them), within the 255-register budget, as for the Hadamard
rotation's largest block (``reference.MAX_HADAMARD_BLOCK``). A 2**16 tile would need 16 warps
x 128 values plus the uniforms: register spills and a compile that takes minutes. The CPU path
and the torch reference refuse the same sizes, so a setting that works on CPU works on a GPU."""

QUANT_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Floating dtypes accepted as input and produced as output."""


def qmax(bits: int) -> int:
    """Largest code magnitude for a bit width (symmetric range, -qmax..qmax)."""
    check_bits(bits)
    return 2 ** (bits - 1) - 1


def check_bits(bits: int) -> None:
    """``bits`` is an int the kernels take (``8.0`` equals 8 but would fail later, sizing a tensor)."""
    if isinstance(bits, bool) or not hasattr(bits, "__index__") or bits not in SUPPORTED_BITS:
        raise ValueError(
            f"bits={bits!r} is not supported by the quantization kernels; use an int, one of "
            f"{SUPPORTED_BITS} (or no quantization)"
        )


def check_group_size(group_size: int, bits: int) -> None:
    if not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if group_size > MAX_GROUP_SIZE:
        raise ValueError(
            f"group_size={group_size} is larger than the quantization kernels' largest block, "
            f"{MAX_GROUP_SIZE} elements (one block is one GPU program's tile, held in registers); use "
            f"group_size <= {MAX_GROUP_SIZE} (the defaults are {DEFAULT_WEIGHT_GROUP_SIZE} for weights and "
            f"{DEFAULT_GRAD_GROUP_SIZE} for gradients)"
        )
    if bits == 4 and group_size % 2:
        raise ValueError(f"group_size={group_size} is odd; INT4 packs two codes per byte, so use an even group size")


def check_seed(seed: int) -> int:
    """Philox takes a 64-bit key; negative or oversized seeds would be read differently by Triton
    (sign extension) and by the torch reference, so they are refused rather than silently remapped.
    Returns the seed as a plain int (numpy / torch integer scalars are accepted)."""
    try:
        value = operator.index(seed)
    except TypeError:
        raise ValueError(f"seed must be an int in [0, 2**63), got {seed!r}") from None
    if not 0 <= value < 2**63:
        raise ValueError(f"seed must be an int in [0, 2**63), got {seed!r}")
    return value


def num_groups(cols: int, group_size: int) -> int:
    """Blocks per row: ceil(cols / group_size); a zero-length row still has zero groups."""
    return math.ceil(cols / group_size)


def row_bytes(cols: int, bits: int, group_size: int) -> int:
    """Bytes of codes per row (padded to whole blocks)."""
    return num_groups(cols, group_size) * group_size * bits // 8


def quantized_nbytes(rows: int, cols: int, bits: int, group_size: int) -> int:
    """Total bytes (codes + fp32 scales) that ``rows x cols`` elements occupy once quantized."""
    return rows * (row_bytes(cols, bits, group_size) + 4 * num_groups(cols, group_size))


@dataclasses.dataclass(frozen=True)
class QuantizedTensor:
    """Codes and scales of a block-quantized tensor (see the module docstring for the format).

    ``codes`` and ``scales`` may carry extra leading dimensions (``[k, rows, ...]``) when k
    quantized tensors of the same layout are stacked, as a reduce does.
    """

    codes: torch.Tensor
    """``[..., rows, row_bytes]``: int8 for INT8, uint8 (two codes per byte) for INT4."""
    scales: torch.Tensor
    """``[..., rows, groups]`` fp32: one scale per block; 0 for zero blocks, NaN for non-finite ones."""
    cols: int
    """Elements per row before padding."""
    bits: int
    """4 or 8."""
    group_size: int
    """Elements per block."""

    def __post_init__(self) -> None:
        check_bits(self.bits)
        check_group_size(self.group_size, self.bits)
        g = num_groups(self.cols, self.group_size)
        rb = row_bytes(self.cols, self.bits, self.group_size)
        if self.codes.shape[-1] != rb or self.scales.shape[-1] != g:
            raise ValueError(
                f"QuantizedTensor layout mismatch: cols={self.cols}, bits={self.bits}, "
                f"group_size={self.group_size} needs codes [..., {rb}] and scales [..., {g}], got "
                f"{tuple(self.codes.shape)} and {tuple(self.scales.shape)}"
            )
        if self.codes.shape[:-1] != self.scales.shape[:-1]:
            raise ValueError(
                f"codes {tuple(self.codes.shape)} and scales {tuple(self.scales.shape)} disagree on leading dims"
            )
        if self.scales.dtype != torch.float32:
            raise ValueError(f"scales must be float32, got {self.scales.dtype}")
        want = torch.int8 if self.bits == 8 else torch.uint8
        if self.codes.dtype != want:
            raise ValueError(f"INT{self.bits} codes must be {want}, got {self.codes.dtype}")

    @classmethod
    def unchecked(
        cls, codes: torch.Tensor, scales: torch.Tensor, cols: int, bits: int, group_size: int
    ) -> QuantizedTensor:
        """Build without ``__post_init__``'s checks (about 2 us per call): only for launchers that
        allocated ``codes`` and ``scales`` themselves from a layout they already checked."""
        q = object.__new__(cls)
        for name, value in (
            ("codes", codes),
            ("scales", scales),
            ("cols", cols),
            ("bits", bits),
            ("group_size", group_size),
        ):
            object.__setattr__(q, name, value)
        return q

    @property
    def rows(self) -> int:
        return self.codes.shape[-2]

    @property
    def nbytes(self) -> int:
        """Bytes of codes plus scales: what travels over the wire."""
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * 4


def check_float_dtype(dtype: torch.dtype, what: str) -> None:
    if dtype not in QUANT_FLOAT_DTYPES:
        raise ValueError(f"{what} dtype {dtype} is not supported; use float32, bfloat16 or float16")


def codes_dtype(bits: int) -> torch.dtype:
    """Storage dtype of the codes: int8 for INT8, uint8 (two codes per byte) for INT4."""
    return torch.int8 if bits == 8 else torch.uint8


def split_rows(numel: int, rows: int) -> int:
    """Columns per row for ``numel`` elements in ``rows`` equal rows, with a clear error if uneven."""
    if isinstance(rows, bool) or not hasattr(rows, "__index__") or rows <= 0:
        raise ValueError(f"rows must be a positive int, got {rows!r}")
    if numel % rows:
        raise ValueError(
            f"cannot split {numel} elements into {rows} equal rows; pad the tensor to a multiple of {rows}"
        )
    return numel // rows


# ----------------------------------------------------------------------------------------------
# Argument checks shared by every implementation (torch reference, fast CPU path, Triton), so
# that all of them refuse the same inputs with the same message.
# ----------------------------------------------------------------------------------------------
def check_quantize_args(x: torch.Tensor, bits: int, group_size: int, rows: int, seed: int) -> tuple[int, int]:
    """Checks of ``quantize``; returns ``(cols, seed)`` (the seed as a plain int)."""
    check_bits(bits)
    check_group_size(group_size, bits)
    check_float_dtype(x.dtype, "input")
    seed = check_seed(seed)
    return split_rows(x.numel(), rows), seed


def check_dims(q: QuantizedTensor, stacked: bool, what: str) -> tuple[int, int]:
    """``dequantize`` takes ``[rows, *]`` codes, the reductions stacked ``[k, rows, *]`` codes.
    Returns ``(k, rows)`` (k = 1 when not stacked)."""
    want = 3 if stacked else 2
    if q.codes.dim() != want:
        shape = "[k, rows, *]" if stacked else "[rows, *]"
        hint = "" if stacked else "; use dequantize_sum for stacked inputs"
        raise ValueError(f"{what} takes codes shaped {shape}, got {tuple(q.codes.shape)}{hint}")
    return (q.codes.shape[0] if stacked else 1), q.codes.shape[-2]


def check_requantize_args(q: QuantizedTensor, bits: int, group_size: int, seed: int) -> tuple[int, int, int]:
    """Checks of ``dequantize_sum_requantize``; returns ``(k, rows, seed)``."""
    check_bits(bits)
    k, rows = check_dims(q, True, "dequantize_sum_requantize")
    seed = check_seed(seed)
    if group_size != q.group_size:
        raise ValueError(
            f"dequantize_sum_requantize keeps the block layout: group_size={group_size} must equal "
            f"the input's {q.group_size}"
        )
    check_group_size(group_size, bits)
    return k, rows, seed


def check_out_buffer(out: torch.Tensor, numel: int, device: torch.device) -> None:
    """A caller-provided output buffer must be a contiguous float tensor of ``numel`` elements on
    the data's device (the kernels write it as a flat ``[rows, cols]`` buffer)."""
    check_float_dtype(out.dtype, "out")
    if out.numel() != numel:
        raise ValueError(f"out has {out.numel()} elements, expected rows*cols = {numel}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous: it is written as a flat [rows, cols] buffer")
    if out.device != device:
        raise ValueError(f"out is on {out.device}, the quantized data on {device}")


def check_quantized_out(
    out: QuantizedTensor, rows: int, cols: int, bits: int, group_size: int, device: torch.device
) -> None:
    """A caller-provided quantized output must have exactly the result's layout (``[rows, *]``
    codes and scales for ``cols`` elements per row at ``bits`` / ``group_size``), be contiguous
    (the kernels write flat buffers) and live on the data's device."""
    if not isinstance(out, QuantizedTensor):
        raise TypeError(f"out must be a QuantizedTensor, got {type(out).__name__}")
    got = (out.codes.dim(), out.rows, out.cols, out.bits, out.group_size)
    if got != (2, rows, cols, bits, group_size):
        raise ValueError(
            f"out does not fit the result: it holds codes {tuple(out.codes.shape)} for cols={out.cols}, "
            f"bits={out.bits}, group_size={out.group_size}; the result needs codes "
            f"[{rows}, {row_bytes(cols, bits, group_size)}] and scales [{rows}, {num_groups(cols, group_size)}] "
            f"for cols={cols}, bits={bits}, group_size={group_size}"
        )
    if row_stride(out.codes) is None or row_stride(out.scales) is None:
        raise ValueError(
            "out.codes and out.scales must be row-strided (each row contiguous, rows a fixed stride apart, "
            f"as views into a wire buffer are); got strides {out.codes.stride()} and {out.scales.stride()}"
        )
    if out.codes.device != device or out.scales.device != device:
        raise ValueError(f"out is on {out.codes.device} / {out.scales.device}, the data on {device}")


def output_buffer(
    out: torch.Tensor | None, rows: int, cols: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``out`` checked (its dtype wins), or a new ``[rows, cols]`` tensor of ``dtype``."""
    if out is None:
        check_float_dtype(dtype, "output")
        return torch.empty(rows, cols, dtype=dtype, device=device)
    check_out_buffer(out, rows * cols, device)
    return out


# ----------------------------------------------------------------------------------------------
# Row-strided tensors: the collectives hand the kernels views into one wire buffer (codes and
# scales of each destination's row side by side), so rows are a fixed stride apart instead of
# packed. These helpers say whether a tensor is laid out that way and with which stride.
# ----------------------------------------------------------------------------------------------
def row_stride(t: torch.Tensor) -> int | None:
    """Elements between consecutive rows of ``t`` ([..., m], the leading dims flattened into rows)
    when every row is contiguous and all rows are one fixed stride apart; None otherwise.
    A contiguous tensor has row stride ``m``."""
    if t.dim() == 0:
        return None
    m = t.shape[-1]
    if m > 1 and t.stride(-1) != 1:
        return None
    lead = [(size, st) for size, st in zip(t.shape[:-1], t.stride()[:-1]) if size != 1]
    if not lead:
        return m
    stride = lead[-1][1]
    for (_size_hi, st_hi), (size_lo, st_lo) in zip(lead[:-1], lead[1:]):
        if st_hi != st_lo * size_lo:
            return None
    if stride < m:
        return None  # overlapping rows: never a valid output, and not what any caller builds
    return stride


def row_geometry(x: torch.Tensor, rows: int, cols: int) -> tuple[int, int, int] | None:
    """``(inner, outer, stride)`` such that row ``r`` of ``x`` (``rows`` rows of ``cols``) starts
    ``(r // inner) * outer + (r % inner) * stride`` elements after ``x``'s first element, each row
    contiguous; None when ``x`` is not laid out so (the caller makes it contiguous). Two levels
    cover a contiguous tensor, a row-strided one and a swizzled view ``[a, b, cols]`` of a
    contiguous ``[b, a, cols]`` tensor (qgZ's local-major order) without a copy."""
    if x.is_contiguous():
        return rows, 0, cols
    if x.dim() < 2 or x.shape[-1] != cols or (cols > 1 and x.stride(-1) != 1):
        return None
    lead = [(size, st) for size, st in zip(x.shape[:-1], x.stride()[:-1]) if size != 1]
    if len(lead) == 1:
        return rows, 0, lead[0][1]
    if len(lead) == 2:
        return lead[1][0], lead[0][1], lead[1][1]
    s = row_stride(x)
    return None if s is None else (rows, 0, s)


def output_rows(
    out: torch.Tensor | None, rows: int, cols: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, int]:
    """Like :func:`output_buffer`, but also accepts a row-strided ``[rows, cols]`` ``out`` (for
    example columns ``[a:b]`` of a ``[rows, S]`` gathered buffer). Returns ``(out, row stride)``."""
    if out is not None and not out.is_contiguous() and out.dim() == 2 and tuple(out.shape) == (rows, cols):
        s = row_stride(out)
        if s is not None:
            check_float_dtype(out.dtype, "out")
            if out.device != device:
                raise ValueError(f"out is on {out.device}, the quantized data on {device}")
            return out, s
    return output_buffer(out, rows, cols, dtype, device), cols
