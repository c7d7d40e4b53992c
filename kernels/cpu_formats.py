"""The CPU path's native kernels for the floating-point wire formats: ``cpu_formats.cpp``.

Loader and raw calls. Built and cached exactly like ``cpu_native.py`` (same compiler, flags,
cache directory and ``build_cache`` checks; its own library, keyed by its own source).
"""

from __future__ import annotations

import ctypes
import hashlib
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable

import torch

from . import build_cache, cpu_native

SOURCE = Path(__file__).with_name("cpu_formats.cpp")

FAILED: str | None = None
"""Why the format kernels are unavailable in this process (None while they work or are unbuilt)."""

SCHEMES = {"fp8": 0, "mx": 1, "nvfp4": 2}
ELEMENTS = {"e4m3": 0, "e5m2": 1, "e3m2": 2, "e2m3": 3, "e2m1": 4, "int8": 5}

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_LIB: ctypes.CDLL | None = None
_LOCK = threading.Lock()


def _name_and_builder() -> tuple[str, Callable[[Path], None]]:
    """The library's file name (its cache key) and a function that builds it at a given path."""
    cxx = cpu_native._compiler()
    timeout = cpu_native.BUILD_TIMEOUT_S
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True, timeout=timeout).stdout
    key = hashlib.sha256(
        "\n".join([SOURCE.read_text(), " ".join(cpu_native.FLAGS), version, cpu_native._cpu_features()]).encode()
    )

    def build(out: Path) -> None:
        res = subprocess.run(
            [cxx, *cpu_native.FLAGS, str(SOURCE), "-o", str(out)], capture_output=True, text=True, timeout=timeout
        )
        if res.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {res.stderr.strip()[-2000:]}")

    return f"zf_{key.hexdigest()[:20]}.so", build


def _load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    p, i, u, c = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64, ctypes.c_int
    lib.zf_quantize.argtypes = [p, i, c, i, i, c, c, i, c, c, u, p, i, p, i, p, i]
    lib.zf_dequantize.argtypes = [p, i, p, i, p, i, i, i, c, c, i, p, c]
    lib.zf_quantize.restype = lib.zf_dequantize.restype = c
    return lib


def load() -> tuple[ctypes.CDLL, Path]:
    """Load the kernels (from the cache, else built) and return them with their file."""
    name, build = _name_and_builder()
    return build_cache.load_library(cpu_native.cache_dir(), name, build, _load)


def library() -> ctypes.CDLL | None:
    """The loaded kernels (built at the first call), or None when off or unavailable."""
    global _LIB, FAILED
    if not cpu_native.ENABLED:
        return None
    if _LIB is not None or FAILED is not None:
        return _LIB
    with _LOCK:
        if _LIB is None and FAILED is None:
            try:
                _LIB = load()[0]
            except Exception as err:
                FAILED = f"{type(err).__name__}: {err}"
    return _LIB


def available() -> bool:
    """Whether CPU tensors take these kernels in this process (builds them if needed)."""
    return library() is not None


def _check(rc: int, what: str) -> None:
    if rc != 0:
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
    _check(
        lib.zf_quantize(
            x2.data_ptr(),
            x2.stride(0),
            _DTYPES[x2.dtype],
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
    _check(
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
            _DTYPES[out.dtype],
        ),
        "dequantize",
    )


if __name__ == "__main__":  # python -m zeropp.kernels.cpu_formats: build (or find) and load the library
    try:
        print(load()[1], file=sys.stdout)
    except Exception as err:
        print(f"unavailable: {type(err).__name__}: {err}", file=sys.stdout)
