"""Shared pieces of the float-format kernel tests (Triton under the interpreter, and on CUDA):
the cases that cover every scheme and element format, inputs with every awkward value, the
exhaustive probe values of an element format, and the Triton-vs-reference comparison."""

from __future__ import annotations

import math
from types import ModuleType

import torch

from tests.kernel_helpers import assert_same_bits
from zeropp.kernels import format_reference as ref
from zeropp.kernels import triton_formats as tri
from zeropp.kernels.format_layout import ELEMENTS, FormatTensor
from zeropp.kernels.format_reference import decode_elements

SCHEME_CASES = [
    ("fp8", "e4m3", "ocp", 100),  # a group size that is not a power of two and does not divide 257
    ("fp8", "e5m2", "ocp", 4),  # many groups per tile
    ("mx", "e4m3", "ocp", 32),
    ("mx", "e5m2", "round_up", 32),
    ("mx", "e3m2", "ocp", 32),
    ("mx", "e2m3", "round_up", 32),
    ("mx", "e2m1", "ocp", 32),
    ("mx", "e2m1", "round_up", 32),
    ("mx", "int8", "ocp", 32),
    ("mx", "int8", "round_up", 32),
    ("nvfp4", "e2m1", "ocp", 16),
]
"""``(scheme, element format, MX scale rule, group size)``: every element format of every scheme,
both MX scale rules over the 8-, 6- and 4-bit widths."""

ELEMENT_CASES = {
    "e4m3": ("fp8", 32),
    "e5m2": ("fp8", 32),
    "e3m2": ("mx", 32),
    "e2m3": ("mx", 32),
    "e2m1": ("mx", 32),
    "int8": ("mx", 32),
}
"""Element format -> ``(scheme, group size)`` that carries it with a scale of exactly 1 when each
block's largest magnitude is the format's max (fp8: ``max / max``; mx: ``2**(emax - emax)``)."""


def format_inputs(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0, huge: bool = True) -> torch.Tensor:
    """Gaussian data (x3) with, where the tensor is big enough: a zero block, a -0.0 run, a block
    of fp32 subnormals, a block of small values beside one large one (they land in the element
    formats' subnormals or flush to zero), a value just under a power of two (the MX round-up
    rule's case, and saturation under OCP), the largest finite fp32 (unless ``huge`` is False:
    nvfp4 scales a whole row by its absmax, so that value zeroes every other block of its row),
    NaN, +Inf and -Inf. Small tensors get a -0.0 and a subnormal."""
    n = math.prod(shape)
    g = torch.Generator().manual_seed(seed)
    flat = torch.randn(n, generator=g) * 3
    if n >= 7:
        flat[1], flat[3] = -0.0, 1e-40
    if n > 280:
        flat[32:64] = 0.0
        flat[64:72] = -0.0
        flat[96:128] = torch.randn(32, generator=g) * 1e-39
        flat[128:160] = torch.randn(32, generator=g) * 1e-3
        flat[130] = 500.0
        flat[224] = 127.9
        if huge:
            flat[161] = torch.finfo(torch.float32).max
        flat[200] = float("nan")
        flat[260] = float("-inf")
        flat[275] = float("inf")
    return flat.view(shape).to(dtype)


def useful_huge(scheme: str, rows: int) -> bool:
    """Whether ``format_inputs`` may hold the largest fp32: not for a single nvfp4 row, which it
    would reduce to one nonzero block (several rows keep the others' blocks meaningful)."""
    return scheme != "nvfp4" or rows > 1


def probe_values(elem: str) -> torch.Tensor:
    """fp32 values exercising every rounding decision of ``elem`` at scale 1: each finite code's
    value, each midpoint of two neighbours (ties to even), the fp32 values beside each midpoint,
    and fp32 subnormals, all with both signs; cut into blocks of 31 with the format's max in
    front of each (so every block's scale is exactly 1)."""
    f = ELEMENTS[elem]
    vals = decode_elements(torch.arange(1 << f.bits), elem)
    vals = vals[torch.isfinite(vals) & (vals.abs() <= f.max)].unique()
    pos = vals[vals >= 0]
    mids = (pos[1:] + pos[:-1]) / 2  # exact: neighbours differ by a few bits
    up = torch.nextafter(mids, torch.full_like(mids, math.inf))
    down = torch.nextafter(mids, torch.zeros_like(mids))
    tiny = torch.tensor([1e-45, 1e-40, 2.0**-126, 2.0**-127])
    probes = torch.cat([pos, mids, up, down, tiny]).clamp(max=f.max)
    probes = torch.cat([probes, -probes])
    blocks = -(-probes.numel() // 31)
    out = torch.zeros(blocks, 32)
    out[:, 0] = f.max
    body = torch.zeros(blocks * 31)
    body[: probes.numel()] = probes
    out[:, 1:] = body.view(blocks, 31)
    return out.view(-1)


def assert_same_format(a: FormatTensor, b: FormatTensor) -> None:
    """Same layout, same code bytes, same scale bits (NaN by position), same tensor scales."""
    assert (a.cols, a.scheme, a.elem, a.group_size) == (b.cols, b.scheme, b.elem, b.group_size)
    assert a.codes.dtype == b.codes.dtype and torch.equal(a.codes, b.codes)
    assert_same_bits(a.scales, b.scales)
    assert (a.tensor_scales is None) == (b.tensor_scales is None)
    if a.tensor_scales is not None:
        assert_same_bits(a.tensor_scales, b.tensor_scales)


def run(
    scheme: str,
    impl: ModuleType,
    x: torch.Tensor,
    elem: str,
    rows: int,
    stochastic: bool,
    rule: str = "ocp",
    gs: int = 32,
) -> FormatTensor:
    """``quantize_<scheme>`` of ``impl`` (the ``format_reference`` or the ``triton_formats`` module)."""
    suffix = "_ref" if impl is ref else ""
    kw = dict(rows=rows, stochastic=stochastic, seed=2**40 + 7)
    if scheme == "fp8":
        return getattr(impl, "quantize_fp8" + suffix)(x, elem, gs, **kw)
    if scheme == "mx":
        return getattr(impl, "quantize_mx" + suffix)(x, elem, scale_rule=rule, **kw)
    return getattr(impl, "quantize_nvfp4" + suffix)(x, **kw)


def dequantize(q: FormatTensor, impl: ModuleType, dtype: torch.dtype) -> torch.Tensor:
    """``dequantize_<scheme>`` of ``impl`` (as in :func:`run`) to ``dtype``."""
    suffix = "_ref" if impl is ref else ""
    return getattr(impl, f"dequantize_{q.scheme}{suffix}")(q, dtype=dtype)


def check_case(
    scheme: str, elem: str, rule: str, gs: int, shape: tuple[int, ...], rows: int, dtype: torch.dtype, stochastic: bool
) -> None:
    """Quantize ``format_inputs`` with the Triton kernels and with the reference and compare the
    bits; dequantize the result both ways (to ``dtype``) and compare the bits."""
    x = format_inputs(shape, dtype, seed=len(elem) + rows, huge=useful_huge(scheme, rows))
    want = run(scheme, ref, x, elem, rows, stochastic, rule, gs)
    got = run(scheme, tri, x, elem, rows, stochastic, rule, gs)
    assert_same_format(got, want)
    assert_same_bits(dequantize(got, tri, dtype), dequantize(want, ref, dtype))
