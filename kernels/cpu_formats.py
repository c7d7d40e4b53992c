"""The CPU path of the float and microscaling formats (fp8, mx, nvfp4): ``cpu_formats.cpp``,
bit-identical to ``format_reference.py``, built with the system C++ compiler at first use and
called through ``ctypes``. ``format_ops.py`` dispatches CPU tensors here; the public functions have
the reference's names without ``_ref`` and its signatures.

Why hand-written C++ (as ``cpu_native.py`` for the int scheme, whose reasons hold here too): the
reference makes a dozen full-size passes per call (masks, ``where``s, bit fiddling in int32
tensors), far from a memory copy's speed, and CPU ranks must not run it on every collective. The
kernels read each block once for its absmax, encode it from L1, and pack its codes; MX and NVFP4
rows go through tiles of ``TILE`` elements (one encode loop and one pack per tile, since 16- or
32-element blocks are too short for per-block loops), 6-bit codes are (un)packed with AVX-512 VBMI
byte permutes where the CPU has them. NVFP4 tiles on such CPUs take ``cpu_formats_nvfp4.h``
(``HEADERS``): block maxima by a shuffle tree, 16 block scales per vector, the nearest E2M1 code by
one fp32 addition (``docs/kernels.md`` has why that is ``rintf``'s rounding), 8 blocks packed by one
byte permute; about half the operations of the scalar tiles. MXFP6 and NVFP4 dequantize on such CPUs
take ``cpu_formats_deq.h``: whole rows read in place, each element's value looked up by its code in
a register table of the exactly decoded values, times its block's scale (16 scales per vector).

Why it stays bit-identical (``tests/unit/test_kernels_formats_cpu.py`` checks every format on the
awkward cases and on crafted wire bytes):

- built with ``cpu_native.FLAGS`` (``-O3 -march=native -ffp-contract=off -fno-trapping-math``, no
  ``-ffast-math`` family flag): no fused multiply-adds, IEEE divisions, no flush-to-zero;
- every fp32 operation is the reference's, in its order: ``absmax / max`` and ``x / s`` (fp8),
  ``x * 2**-k`` (mx; the reference's ``pow2`` built from bits), ``absmax / 6 / t`` and ``x / d``
  (nvfp4); an element's code is integer arithmetic on its exponent bits and the rounded mantissa
  count (``((e - emin) << mbits) + r``, which is the format's bit pattern, carries included);
  round-half-even is ``rintf``, which rounds in the thread's rounding mode, round-to-nearest-even
  unless someone changed it (torch does not); the AVX-512 NVFP4 tiles round the same count by an
  fp32 addition in that same mode;
- a code decodes exactly: a normal code's exponent and mantissa bits placed in an fp32 pattern and
  its exponent rebiased by an integer add, a subnormal code as ``mag * 2**(emin - mbits)``, so no
  fp32 subnormal is an operand (those take slow paths on x86; 6-bit blocks hold many subnormal
  codes). The 8- and 4-bit vector decode keeps the shorter exact form, the magnitude bits in an
  fp32 pattern times ``2**(127 - bias)``, which measured faster there. The AVX-512 MXFP6 / NVFP4
  dequantize looks the same values up (a table the scalar decode fills) and multiplies them by the
  same block scale (built from its bits as the scalar path does): the same single fp32 product;
- bf16 / fp16 inputs are widened exactly; outputs round to nearest even as torch's casts do; a bf16
  output is converted with ``vcvtneps2bf16`` (AVX512-BF16) only in blocks whose scale is finite
  and either 0 or large enough that no nonzero product is an fp32 subnormal (that instruction
  treats denormals as zero; elsewhere it rounds as torch); the AVX-512 MXFP6 / NVFP4 dequantize
  checks each 32 products instead (``vfpclassps``: none NaN or subnormal) and otherwise rounds
  them by torch's integer rule on whole vectors. NaN payloads are not promised: torch's
  own bf16 casts write different NaN bits on different paths;
- zero, non-finite and zero-scale blocks follow the reference's rules (its module docstring).

The wire-row operations (quantize straight into wire rows, the fused reductions over received
rows) are ``cpu_format_wire.py``'s, on this module's library; their names (``encode_wire``,
``dequantize_sum_wire``, ``dequantize_sum_requantize_wire``) are read from here too.

The build and its cache are ``cpu_native.py``'s (same compiler, flags, cache directory and
``build_cache`` checks), for a library of its own keyed by this source (``zf_<hash>.so``); its
loading and ``ctypes`` binding are ``cpu_format_library.py``'s, re-exported here with the wire-row
operations, so both modules use one library and neither imports this one.
``ZEROPP_CPU_NATIVE=0`` turns these kernels off with the int ones. If the build or the load
fails, :func:`native_enabled` warns once and the public functions run the reference instead.
"""

from __future__ import annotations

import sys

import torch

from . import cpu_format_library, cpu_native, format_reference
from .cpu_format_library import (
    DTYPES,
    ELEMENTS,
    HEADERS,
    SCHEMES,
    SOURCE,
    available,
    check_rc,
    dequantize_into,
    library,
    load,
    native_enabled,
    philox_uniform,
    quantize_into,
)
from .cpu_format_wire import dequantize_sum_requantize_wire, dequantize_sum_wire, encode_wire
from .format_layout import (
    FIXED_GROUP_SIZE,
    FormatTensor,
    check_format_args,
    check_format_tensor,
    check_scale_rule,
    code_bytes,
)
from .layout import check_float_dtype, num_groups, output_buffer

__all__ = [
    "DTYPES",
    "ELEMENTS",
    "HEADERS",
    "SCHEMES",
    "SOURCE",
    "available",
    "check_rc",
    "dequantize_fp8",
    "dequantize_into",
    "dequantize_mx",
    "dequantize_nvfp4",
    "dequantize_sum_requantize_wire",
    "dequantize_sum_wire",
    "encode_wire",
    "library",
    "load",
    "native_enabled",
    "philox_uniform",
    "quantize_fp8",
    "quantize_into",
    "quantize_mx",
    "quantize_nvfp4",
]


def __getattr__(name: str) -> str | None:
    """``FAILED``, why the kernels are unavailable, read where the library keeps it: it changes when
    the first call builds the library, so a copy taken at import would stay None."""
    if name == "FAILED":
        return cpu_format_library.FAILED
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _quantize(
    x: torch.Tensor, scheme: str, elem: str, group_size: int, scale_rule: str, rows: int, stochastic: bool, seed: int
) -> FormatTensor:
    """The checked arguments through the native kernel into fresh codes and scales."""
    cols, seed = check_format_args(x, scheme, elem, group_size, rows, seed)
    if x.device.type != "cpu":
        raise ValueError(f"zeropp.kernels.cpu_formats takes CPU tensors, got one on {x.device}")
    g = num_groups(cols, group_size)
    codes = cpu_native.empty(rows, code_bytes(cols, elem, group_size), dtype=torch.uint8)
    scales = cpu_native.empty(rows, g, dtype=torch.float32 if scheme == "fp8" else torch.uint8)
    tscales = torch.empty(rows, 1, dtype=torch.float32) if scheme == "nvfp4" else None
    x2 = x.reshape(rows, cols)
    if cols > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    quantize_into(x2, scheme, elem, group_size, scale_rule == "round_up", stochastic, seed, codes, scales, tscales)
    return FormatTensor(codes, scales, tscales, cols, scheme, elem, group_size)


def _dequantize(q: FormatTensor, scheme: str, out: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """A checked FormatTensor through the native kernel into ``out`` (or a fresh tensor); the
    reference's ``dequantize_<scheme>_ref`` where the kernels are unavailable."""
    if not native_enabled():
        return getattr(format_reference, f"dequantize_{scheme}_ref")(q, out=out, dtype=dtype)
    rows = check_format_tensor(q, scheme)
    if q.codes.device.type != "cpu":
        raise ValueError(f"zeropp.kernels.cpu_formats takes CPU tensors, got one on {q.codes.device}")
    if out is None:
        check_float_dtype(dtype, "output")
        dst = cpu_native.empty(rows, q.cols, dtype=dtype)
    else:
        dst = output_buffer(out, rows, q.cols, dtype, q.codes.device)
    last = [t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous() for t in (q.codes, q.scales)]
    dequantize_into(last[0], last[1], q.tensor_scales, scheme, q.elem, q.group_size, q.cols, dst)
    return dst


# ----------------------------------------------------------------------------------------------
# Public functions: format_reference's names without ``_ref``, the same signatures and results.
# ----------------------------------------------------------------------------------------------
def quantize_fp8(
    x: torch.Tensor, elem: str, group_size: int, *, rows: int = 1, stochastic: bool = False, seed: int = 0
) -> FormatTensor:
    """``format_reference.quantize_fp8_ref``, bit for bit."""
    if not native_enabled():
        return format_reference.quantize_fp8_ref(x, elem, group_size, rows=rows, stochastic=stochastic, seed=seed)
    return _quantize(x, "fp8", elem, group_size, "ocp", rows, stochastic, seed)


def quantize_mx(
    x: torch.Tensor, elem: str, *, scale_rule: str = "ocp", rows: int = 1, stochastic: bool = False, seed: int = 0
) -> FormatTensor:
    """``format_reference.quantize_mx_ref``, bit for bit."""
    if not native_enabled():
        return format_reference.quantize_mx_ref(
            x, elem, scale_rule=scale_rule, rows=rows, stochastic=stochastic, seed=seed
        )
    check_scale_rule(scale_rule)
    return _quantize(x, "mx", elem, FIXED_GROUP_SIZE["mx"], scale_rule, rows, stochastic, seed)


def quantize_nvfp4(x: torch.Tensor, *, rows: int = 1, stochastic: bool = False, seed: int = 0) -> FormatTensor:
    """``format_reference.quantize_nvfp4_ref``, bit for bit."""
    if not native_enabled():
        return format_reference.quantize_nvfp4_ref(x, rows=rows, stochastic=stochastic, seed=seed)
    return _quantize(x, "nvfp4", "e2m1", FIXED_GROUP_SIZE["nvfp4"], "ocp", rows, stochastic, seed)


def dequantize_fp8(
    q: FormatTensor, *, out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``format_reference.dequantize_fp8_ref``, bit for bit."""
    return _dequantize(q, "fp8", out, dtype)


def dequantize_mx(
    q: FormatTensor, *, out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``format_reference.dequantize_mx_ref``, bit for bit."""
    return _dequantize(q, "mx", out, dtype)


def dequantize_nvfp4(
    q: FormatTensor, *, out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``format_reference.dequantize_nvfp4_ref``, bit for bit."""
    return _dequantize(q, "nvfp4", out, dtype)


if __name__ == "__main__":  # python -m zeropp.kernels.cpu_formats: build (or find) and load the library
    try:
        print(load()[1], file=sys.stdout)
    except Exception as err:
        print(f"unavailable: {type(err).__name__}: {err}", file=sys.stdout)
