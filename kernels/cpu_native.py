"""The CPU path's native kernels: ``cpu_native.cpp`` (the reference's arithmetic, one pass per
block, bit-identical to ``reference.py``), built with the system C++ compiler at first use and
called through ``ctypes``. What CPU ranks run (``cpu.py`` dispatches here first).

Why hand-written C++ rather than ``torch.compile`` of the reference (``cpu_fused.py``, the path
before this one): inductor's code for the formulation made several passes per block and left the
INT4 nibble (un)packing to gcc's auto-vectoriser through int16 byte-pair tricks; its compiled
kernels reached 2-3x the tiled eager path. The C++ here reads each block once for its absmax
(an integer maximum over bit patterns, see the .cpp) and once, from L1, for its codes, with
loops gcc vectorises (``vdivps``/``vroundps`` on whole vectors), and the call costs a few
microseconds of ``ctypes`` instead of a dynamo guard check. Why ``ctypes`` on a plain shared
library rather than ``torch.utils.cpp_extension``: the source includes no torch or Python
headers, so it builds in a few seconds instead of a minute or more, and one build serves every torch
version; tensors are passed as data pointers and strides.

Why it stays bit-identical (``tests/{unit,e2e}/test_kernels.py`` checks it on the awkward cases):

- compiled with ``-O3 -march=native -ffp-contract=off -fno-trapping-math`` and no value-changing
  ``-ffast-math`` family flag: no fused multiply-adds, divisions stay IEEE divisions (gcc never
  turns ``x / s`` into ``x * (1 / s)`` without ``-freciprocal-math``), no reassociation of the
  ordered sums, and no flush-to-zero (the process's MXCSR, which torch leaves at IEEE defaults).
  ``-fno-trapping-math`` only lets gcc vectorise ``floorf`` and the float-to-int conversion: it
  assumes floating-point exceptions do not trap (the default state) and changes no value;
- each element sees the reference's operations in its order: ``floor(x / scale + 0.5)`` (or
  ``+ u`` with the reference's Philox uniform at the same padded-layout offset), clamp, the
  narrowing cast; ``code * scale``; ``0 + d_0 + ... + d_{k-1}``;
- bf16 / fp16 inputs are widened exactly; outputs are rounded to nearest even as torch's casts
  do (bf16 NaN becomes a NaN, as in torch, with payload not guaranteed to match bit for bit).
  On CPUs with AVX512-BF16, a plain dequantize to bf16 rounds with ``vcvtneps2bf16`` only in
  blocks whose scale is finite and normal or zero: that instruction treats denormals as zero,
  and such a block's products are +-0, normal or +-Inf, where it agrees with torch's rounding;
- NaN / Inf / zero-scale blocks follow the reference's rules (scale NaN and codes 0; codes 0).

The build: ``g++`` (or ``$CXX``) with the flags in ``FLAGS`` into a cache directory
(:func:`cache_dir`: ``$ZEROPP_CACHE_DIR``, else ``$XDG_CACHE_HOME/zeropp``, else
``~/.cache/zeropp``; then ``cpu_native/``), keyed by a hash of the source, the flags, the
compiler's version and the CPU's feature flags (``-march=native`` code must never run on a CPU
without those features). Later processes load the cached library without compiling, but only
after ``build_cache.py``'s checks: directory and file owned by this user and not writable by
others, the file's sha256 equal to the one recorded at build. An empty, corrupt or mismatched
file is rebuilt; an unsafe cache is never loaded (one warning, then a private build). Concurrent
ranks building at once take a file lock. If the build or the load fails, :func:`library`
returns None and says why in :data:`FAILED`; ``cpu.py`` then warns once and keeps to the
compiled / tiled paths.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable

import torch

from . import build_cache

SOURCE = Path(__file__).with_name("cpu_native.cpp")
HEADER = Path(__file__).with_name("cpu_common.h")
"""What ``cpu_native.cpp`` and ``cpu_formats.cpp`` share (included by both, hashed into both keys)."""

ENABLED = os.environ.get("ZEROPP_CPU_NATIVE", "1") != "0"
"""Whether CPU tensors take these kernels (``ZEROPP_CPU_NATIVE=0`` turns them off, for comparing
paths; tests switch it per test)."""

FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-trapping-math", "-fPIC", "-shared", "-std=c++17"]
"""Compiler flags. ``-ffp-contract=off``: no FMA contraction (bit-exactness). On x86-64, 512-bit
vectors are preferred where the CPU has them (gcc otherwise keeps to 256 bits on AVX-512 CPUs)."""
if platform.machine() in ("x86_64", "AMD64"):
    FLAGS.append("-mprefer-vector-width=512")

FAILED: str | None = None
"""Why the native kernels are unavailable in this process (None while they work or are unbuilt)."""

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_LIB: ctypes.CDLL | None = None
_LOCK = threading.Lock()


def _cpu_features() -> str:
    """The CPU's feature flags (what ``-march=native`` compiles for), for the cache key."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() + platform.machine()


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError("no C++ compiler found (set CXX or install g++)")
    return cxx


BUILD_TIMEOUT_S = 600.0
"""The longest one compiler run may take (a hung compiler fails the build instead of the run)."""


def cache_dir() -> Path:
    """Where built libraries are kept: ``$ZEROPP_CACHE_DIR``, else ``$XDG_CACHE_HOME/zeropp``,
    else ``~/.cache/zeropp``; then ``cpu_native``."""
    base = os.environ.get("ZEROPP_CACHE_DIR")
    if not base:
        base = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "zeropp")
    return Path(base) / "cpu_native"


def named_build(
    source: Path, flags: list[str], prefix: str, headers: tuple[Path, ...] = ()
) -> tuple[str, Callable[[Path], None]]:
    """The file name of the library built from ``source`` with ``flags`` (``<prefix>_<hash>.so``:
    its cache key, a hash of the source, the shared header, the source's own ``headers``, the
    flags, the compiler's version and the CPU's feature flags) and a function that builds it at a
    given path. Shared by every native loader."""
    cxx = _compiler()
    version = subprocess.run(
        [cxx, "--version"], capture_output=True, text=True, check=True, timeout=BUILD_TIMEOUT_S
    ).stdout
    # the shared header (kernels/cpu_common.h) is part of every library's source: hashed into each key
    texts = [source.read_text(), HEADER.read_text(), *(h.read_text() for h in headers)]
    key = hashlib.sha256("\n".join([*texts, " ".join(flags), version, _cpu_features()]).encode())

    def build(out: Path) -> None:
        res = subprocess.run(
            [cxx, *flags, str(source), "-o", str(out)], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
        )
        if res.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {res.stderr.strip()[-2000:]}")

    return f"{prefix}_{key.hexdigest()[:20]}.so", build


def _name_and_builder() -> tuple[str, Callable[[Path], None]]:
    """The library's file name (its cache key) and a function that builds it at a given path."""
    return named_build(SOURCE, FLAGS, "zq")


def _build() -> Path:
    """The checked cached library for this source, flags, compiler and CPU, built if needed
    (not loaded). Raises ``build_cache.UnsafeCache`` where the cache must not be used."""
    name, build = _name_and_builder()
    return build_cache.cached_library(cache_dir(), name, build)[1]


def _bind(lib: ctypes.CDLL) -> None:
    p, i, u = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64
    c = ctypes.c_int
    lib.zq_quantize.argtypes = [p, i, c, i, i, i, c, c, u, p, i, p, i]
    lib.zq_dequantize.argtypes = [p, i, i, p, i, i, i, i, i, i, c, c, p, c]
    lib.zq_requantize.argtypes = [p, i, i, p, i, i, i, i, i, i, c, c, c, u, p, i, p, i]
    for fn in (lib.zq_quantize, lib.zq_dequantize, lib.zq_requantize):
        fn.restype = c


def _load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    _bind(lib)
    return lib


def load() -> tuple[ctypes.CDLL, Path]:
    """Load the kernels (from the cache, else built; see the module docstring) and return them
    with the file they came from. Raises what went wrong."""
    name, build = _name_and_builder()
    return build_cache.load_library(cache_dir(), name, build, _load)


def library() -> ctypes.CDLL | None:
    """The loaded kernels (built at the first call), or None when they are off or unavailable."""
    return build_cache.load_once(sys.modules[__name__], load) if ENABLED else None


def available() -> bool:
    """Whether CPU tensors take the native kernels in this process (builds them if needed)."""
    return ENABLED and library() is not None


_HUGE = 2 << 20
_MADV_HUGEPAGE = 14
_madvise = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
        _madvise = _libc.madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        _madvise = None


def empty(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty`` for a kernel's fresh output, with transparent huge pages asked for when it
    spans several of them (Linux ``madvise(MADV_HUGEPAGE)`` on its whole pages; only a hint).
    Why: every call returns new codes, and a large allocation is new memory from the kernel, so
    the first write faults in each page; on the dev machine 4 KiB faults cost about 30 ms per
    32 MiB of codes (more than quantizing them), 2 MiB pages about a third of that."""
    t = torch.empty(*shape, dtype=dtype)
    nbytes = t.numel() * t.element_size()
    if _madvise is not None and nbytes >= 2 * _HUGE:
        start = -(-t.data_ptr() // 4096) * 4096
        stop = (t.data_ptr() + nbytes) // 4096 * 4096
        _madvise(start, stop - start, _MADV_HUGEPAGE)  # failure (no THP) just leaves small pages
    return t


def _check(rc: int, what: str) -> None:
    if rc != 0:  # arguments are validated before the call: this is a bug or out of memory
        raise RuntimeError(f"zeropp.kernels.cpu_native: {what} failed (rc={rc})")


# ----------------------------------------------------------------------------------------------
# Calls. Tensors are CPU, last dimension contiguous; the callers (cpu.py) check the arguments.
# ----------------------------------------------------------------------------------------------
def quantize_into(
    x2: torch.Tensor, bits: int, gs: int, stochastic: bool, seed: int, codes: torch.Tensor, scales: torch.Tensor
) -> None:
    """x2 [rows, cols] (fp32/bf16/fp16, rows may be strided) -> codes [rows, row_bytes], scales [rows, g]."""
    rows, cols = x2.shape
    assert _LIB is not None, "callers load the library first"
    _check(
        _LIB.zq_quantize(
            x2.data_ptr(),
            x2.stride(0),
            _DTYPES[x2.dtype],
            rows,
            cols,
            gs,
            bits,
            int(stochastic),
            seed,
            codes.data_ptr(),
            codes.stride(0),
            scales.data_ptr(),
            scales.stride(0),
        ),
        "quantize",
    )


def dequantize_into(
    codes: torch.Tensor, scales: torch.Tensor, bits: int, gs: int, cols: int, summed: bool, out: torch.Tensor
) -> None:
    """codes [rows, row_bytes] and scales [rows, g] (or stacked [k, rows, *] with ``summed``) ->
    ``out`` (contiguous, rows * cols elements, any float dtype): input 0 dequantized, or the sum
    over k."""
    if codes.dim() == 2:  # one input: k = 1, no k strides (no unsqueezed views on the hot path)
        k, (rows, _), c_ks, s_ks = 1, codes.shape, 0, 0
    else:
        (k, rows, _), c_ks, s_ks = codes.shape, codes.stride(0), scales.stride(0)
    assert _LIB is not None, "callers load the library first"
    _check(
        _LIB.zq_dequantize(
            codes.data_ptr(),
            c_ks,
            codes.stride(-2),
            scales.data_ptr(),
            s_ks,
            scales.stride(-2),
            k,
            rows,
            cols,
            gs,
            bits,
            int(summed),
            out.data_ptr(),
            _DTYPES[out.dtype],
        ),
        "dequantize",
    )


def requantize_into(
    codes: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    gs: int,
    cols: int,
    out_bits: int,
    stochastic: bool,
    seed: int,
    codes_out: torch.Tensor,
    scales_out: torch.Tensor,
) -> None:
    """Stacked [k, rows, *] -> the blocks' fp32 sums re-quantized into codes_out / scales_out [rows, *]."""
    k, rows, _ = codes.shape
    assert _LIB is not None, "callers load the library first"
    _check(
        _LIB.zq_requantize(
            codes.data_ptr(),
            codes.stride(0),
            codes.stride(1),
            scales.data_ptr(),
            scales.stride(0),
            scales.stride(1),
            k,
            rows,
            cols,
            gs,
            bits,
            out_bits,
            int(stochastic),
            seed,
            codes_out.data_ptr(),
            codes_out.stride(0),
            scales_out.data_ptr(),
            scales_out.stride(0),
        ),
        "dequantize_sum_requantize",
    )


if __name__ == "__main__":  # python -m zeropp.kernels.cpu_native: build (or find) and load the library
    try:
        print(load()[1], file=sys.stdout)
    except Exception as err:
        print(f"unavailable: {type(err).__name__}: {err}", file=sys.stdout)
