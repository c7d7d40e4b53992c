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
rows) are ``cpu_format_wire.py``'s, on this module's library.

The build and its cache are ``cpu_native.py``'s (same compiler, flags, cache directory and
``build_cache`` checks), for a library of its own keyed by this source (``zf_<hash>.so``).
``ZEROPP_CPU_NATIVE=0`` turns these kernels off with the int ones. If the build or the load
fails, :func:`native_enabled` warns once and the public functions run the reference instead.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import warnings
from pathlib import Path
from typing import Callable

import torch

from . import build_cache, cpu_native, format_reference
from .format_layout import (
    FIXED_GROUP_SIZE,
    FormatTensor,
    check_format_args,
    check_format_tensor,
    check_scale_rule,
    code_bytes,
)
from .layout import check_float_dtype, num_groups, output_buffer

SOURCE = Path(__file__).with_name("cpu_formats.cpp")
HEADERS = (Path(__file__).with_name("cpu_formats_nvfp4.h"), Path(__file__).with_name("cpu_formats_deq.h"))
"""The source's own headers (beside the shared ``cpu_common.h``), hashed into the build key."""

FAILED: str | None = None
"""Why the format kernels are unavailable in this process (None while they work or are unbuilt)."""

SCHEMES = {"fp8": 0, "mx": 1, "nvfp4": 2}
"""Scheme names -> the C++ entry points' ``scheme`` argument."""
ELEMENTS = {"e4m3": 0, "e5m2": 1, "e3m2": 2, "e2m3": 3, "e2m1": 4, "int8": 5}
"""Element format names -> the C++ entry points' ``fmt`` argument."""

DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""Tensor dtypes -> the C++ entry points' ``dtype`` arguments."""
_LIB: ctypes.CDLL | None = None
_LOCK = threading.Lock()


def _name_and_builder() -> tuple[str, Callable[[Path], None]]:
    """The library's file name (its cache key) and a function that builds it at a given path."""
    return cpu_native.named_build(SOURCE, cpu_native.FLAGS, "zf", HEADERS)


def _load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    p, i, u, c = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64, ctypes.c_int
    lib.zf_quantize.argtypes = [p, i, c, i, i, c, c, i, c, c, u, p, i, p, i, p, i]
    lib.zf_dequantize.argtypes = [p, i, p, i, p, i, i, i, c, c, i, p, c]
    lib.zf_quantize.restype = lib.zf_dequantize.restype = c
    lib.zf_dequantize_sum.argtypes = [p, i, i, i, i, i, c, c, i, i, i, p, c]
    lib.zf_dequantize_sum_requantize.argtypes = [p, i, i, i, i, i, c, c, c, i, i, i, c, c, u, p, i, p, i, p, i, p]
    lib.zf_dequantize_sum.restype = lib.zf_dequantize_sum_requantize.restype = c
    lib.zf_philox_uniform.argtypes = [p, i, u, u]
    lib.zf_philox_uniform.restype = None
    return lib


def load() -> tuple[ctypes.CDLL, Path]:
    """Load the kernels (from the cache, else built) and return them with their file."""
    name, build = _name_and_builder()
    return build_cache.load_library(cpu_native.cache_dir(), name, build, _load)


def library() -> ctypes.CDLL | None:
    """The loaded kernels (built at the first call), or None when off or unavailable."""
    return build_cache.load_once(sys.modules[__name__], load) if cpu_native.ENABLED else None


def available() -> bool:
    """Whether CPU tensors take these kernels in this process (builds them if needed)."""
    return library() is not None


def check_rc(rc: int, what: str) -> None:
    """Raise for a nonzero status of the kernel entry point ``what``."""
    if rc != 0:  # arguments are validated before the call: this is a bug or out of memory
        raise RuntimeError(f"zeropp.kernels.cpu_formats: {what} failed (rc={rc})")


def quantize_into(
    x2: torch.Tensor,
    scheme: str,
    element: str,
    block: int,
    round_up: bool,
    stochastic: bool,
    seed: int,
    codes: torch.Tensor,
    scales: torch.Tensor,
    tscales: torch.Tensor | None,
) -> None:
    """x2 [rows, cols] (fp32/bf16/fp16, last dim contiguous) -> codes [rows, *] (uint8), scales
    [rows, G] (fp32 for fp8, uint8 otherwise), tscales [rows, 1]-like fp32 (nvfp4 only)."""
    rows, cols = x2.shape
    lib = library()
    assert lib is not None, "callers check available() first"
    check_rc(
        lib.zf_quantize(
            x2.data_ptr(),
            x2.stride(0),
            DTYPES[x2.dtype],
            rows,
            cols,
            SCHEMES[scheme],
            ELEMENTS[element],
            block,
            int(round_up),
            int(stochastic),
            seed,
            codes.data_ptr(),
            codes.stride(0),
            scales.data_ptr(),
            scales.stride(0),
            0 if tscales is None else tscales.data_ptr(),
            0 if tscales is None else tscales.stride(0),
        ),
        "quantize",
    )


def dequantize_into(
    codes: torch.Tensor,
    scales: torch.Tensor,
    tscales: torch.Tensor | None,
    scheme: str,
    element: str,
    block: int,
    cols: int,
    out: torch.Tensor,
) -> None:
    """The inverse of :func:`quantize_into` into ``out`` (contiguous rows * cols, any float dtype)."""
    rows = codes.shape[0]
    lib = library()
    assert lib is not None, "callers check available() first"
    check_rc(
        lib.zf_dequantize(
            codes.data_ptr(),
            codes.stride(0),
            scales.data_ptr(),
            scales.stride(0),
            0 if tscales is None else tscales.data_ptr(),
            0 if tscales is None else tscales.stride(0),
            rows,
            cols,
            SCHEMES[scheme],
            ELEMENTS[element],
            block,
            out.data_ptr(),
            DTYPES[out.dtype],
        ),
        "dequantize",
    )


def philox_uniform(seed: int, base: int, n: int) -> torch.Tensor:
    """The ``n`` uniforms of offsets ``base ..`` under ``seed`` that the kernels' stochastic
    rounding draws (``reference.philox_uniform`` of the same offsets, bit for bit)."""
    lib = library()
    assert lib is not None, "callers check available() first"
    u = torch.empty(n, dtype=torch.float32)
    lib.zf_philox_uniform(u.data_ptr(), n, base, seed)
    return u


_warned = False


def native_enabled() -> bool:
    """Whether CPU tensors take these kernels. When they cannot be built or loaded, warns once and
    returns False: the reference (``format_reference.py``) then serves, bit-identical but slower."""
    global _warned
    if available():
        return True
    if FAILED is not None and not _warned:
        _warned = True
        warnings.warn(
            f"zeropp.kernels: the native CPU kernels of the float formats are unavailable ({FAILED}); "
            "using the slower torch reference for the rest of this process",
            RuntimeWarning,
            stacklevel=3,
        )
    return False


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
