"""The build and ``ctypes`` binding of ``cpu_formats.cpp``, the CPU kernels of the float and
microscaling formats: the library (built at first use, cached as ``cpu_native.py``'s), its entry
points' argument codes, and the row-level calls that ``cpu_formats.py`` (whole tensors) and
``cpu_format_wire.py`` (wire rows) both make. Why the kernels are hand-written C++ and how they stay
bit-identical to ``format_reference.py`` is ``cpu_formats.py``'s docstring.

``ZEROPP_CPU_NATIVE=0`` turns these kernels off with the int ones. If the build or the load fails,
:func:`native_enabled` warns once and the callers run the reference instead.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import warnings
from pathlib import Path
from typing import Callable

import torch

from . import build_cache, cpu_native

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
