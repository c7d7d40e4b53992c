"""Shared pieces of the quantization-kernel tests: deterministic inputs (``gaussian``, the
``awkward`` tensors with zero, -0.0, NaN and Inf blocks), bit-for-bit comparisons, and the switch
that routes CPU tensors through one CPU path of kernels/cpu.py (``use_cpu_path``, the
``compiled_path`` fixture)."""

from __future__ import annotations

import math

import pytest
import torch

from zeropp.kernels import QuantizedTensor

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def gaussian(n: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(dtype)


def stack(qs: list[QuantizedTensor]) -> QuantizedTensor:
    """k QuantizedTensors of one layout -> one stacked [k, rows, *] QuantizedTensor."""
    q0 = qs[0]
    return QuantizedTensor(
        torch.stack([q.codes for q in qs]), torch.stack([q.scales for q in qs]), q0.cols, q0.bits, q0.group_size
    )


def assert_bit_identical(a: QuantizedTensor, b: QuantizedTensor) -> None:
    """Same layout, same code bytes, same scale *bits* (NaN payloads and signed zeros included)."""
    assert (a.cols, a.bits, a.group_size, a.codes.dtype) == (b.cols, b.bits, b.group_size, b.codes.dtype)
    assert torch.equal(a.codes, b.codes)
    assert torch.equal(a.scales.view(torch.int32), b.scales.view(torch.int32))


def awkward(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Gaussian data with a zero block, a -0.0 run, NaN and Inf (where the tensor is big enough)."""
    x = (gaussian(math.prod(shape), seed) * 3).view(shape)
    flat = x.view(-1)
    if flat.numel() > 300:
        flat[100:200] = 0
        flat[290:300] = -0.0
        flat[5] = float("nan")
        flat[250] = float("inf")
    return x.to(dtype)


def use_cpu_path(monkeypatch, path: str) -> None:
    """Route CPU tensors through one CPU path of kernels/cpu.py for this test: "native" (the C++
    kernels of kernels/cpu_native.py, what ranks run), "compiled" (kernels/cpu_fused.py for every
    tensor with a whole block, however small) or "tiled" (the tiles only, whatever the size)."""
    from zeropp.kernels import cpu, cpu_fused, cpu_native

    monkeypatch.setattr(cpu_native, "ENABLED", path == "native")
    if path == "native" and not cpu_native.available():
        pytest.skip(f"native CPU kernels unavailable here: {cpu_native.FAILED}")
    if path == "tiled":
        monkeypatch.setattr(cpu_fused, "FUSED_MIN_ELEMS", 2**62)
    if path == "compiled":
        monkeypatch.setattr(cpu_fused, "FUSED_MIN_ELEMS", 0)
        monkeypatch.setattr(cpu_fused, "DEQUANTIZE_MIN_ELEMS", 0)
        monkeypatch.setattr(cpu, "_fused_failed", None)


@pytest.fixture
def compiled_path(monkeypatch):
    """The compiled kernels (kernels/cpu_fused.py) for every tensor with a whole block, however small."""
    from zeropp.kernels import cpu

    use_cpu_path(monkeypatch, "compiled")
    yield
    assert cpu._fused_failed is None, cpu._fused_failed  # the compiled path really ran


COMPILED_SHAPES = [((1,), 1), ((7,), 1), ((17, 257), 17), ((4, 1000), 4), ((3, 70001), 3)]
"""Shorter than a block (tiles only), one compiled call per row (partial last blocks), one call for
all rows (whole blocks), and several rows of many blocks."""


SHAPES = [((1,), 1), ((7,), 1), ((17, 257), 1), ((17, 257), 17)]
"""(shape, rows): a lone element, less than a block, one row of 17*257, and 17 rows of 257."""


def data(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Gaussian values times 3 in ``shape``, cast to ``dtype``: several blocks' scales apart."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3).to(dtype)


def _nan_to_zero(t: torch.Tensor) -> torch.Tensor:
    """NaN -> 0, everything else untouched. (``nan_to_num`` would also map +-inf to the dtype's
    largest finite value, so an inf on one side and the max finite on the other compared equal.)"""
    return torch.where(torch.isnan(t), torch.zeros_like(t), t)


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    """Identical values including NaN positions, infinities and signed zeros (and dtype)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(torch.isnan(a), torch.isnan(b))
    a, b = _nan_to_zero(a), _nan_to_zero(b)
    assert torch.equal(a, b) and torch.equal(torch.signbit(a), torch.signbit(b))


def failing_compiler(tmp_path, monkeypatch) -> None:
    """Make every native build of this test fail for real: ``CXX`` is a script that answers
    ``--version`` and exits 1 on a compile, and the cache is a fresh directory under ``tmp_path``."""
    cxx = tmp_path / "no-such-compiler"
    cxx.write_text('#!/bin/sh\n[ "$1" = --version ] && echo fake 1 && exit 0\nexit 1\n')
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("ZEROPP_CACHE_DIR", str(tmp_path / "cache"))
