"""The float formats' Triton kernels on CUDA (compiled, not the interpreter) against the torch
reference of ``kernels/format_reference.py``, bit for bit: same code bytes, same scale bits, same
output bits.

Every scheme / element format / MX scale rule of ``SCHEME_CASES``; sizes 1, 7, 17x257 (one row and
17 rows) and 2**20 + 3 (2**17 + 3 when stochastic); fp32/bf16/fp16 in and out; round to nearest and
stochastic. The reference
runs on CPU copies of the same inputs, so a difference in the GPU's arithmetic (a fused
multiply-add, a flushed subnormal, a float8 cast, a different Philox stream) fails here. The calls
go through ``format_ops``, so CUDA tensors must also be dispatched to the Triton kernels.
"""

from __future__ import annotations

import pytest
import torch

from tests.format_kernel_helpers import SCHEME_CASES, format_inputs, useful_huge
from zeropp.kernels import format_ops, triton_formats
from zeropp.kernels.format_layout import FormatTensor

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SHAPES = {
    "1": ((1,), 1),
    "7": ((7,), 1),
    "17x257": ((17, 257), 1),
    "17rows": ((17, 257), 17),
    "2**20+3": ((2**20 + 3,), 1),
    "2**17+3": ((2**17 + 3,), 1),
}
ROUNDINGS = [  # (shape, stochastic): stochastic stops at 2**17 + 3, whose Philox reference on CPU
    # takes seconds; at 2**20 + 3 it took 20-33 s a case on an H200 host and the GPU check ran out of time
    pytest.param(shape, stochastic, id=f"{shape}-{'stochastic' if stochastic else 'nearest'}")
    for shape in SHAPES
    for stochastic in (False, True)
    if (shape != "2**20+3" or not stochastic) and (shape != "2**17+3" or stochastic)
]
SEED = 2**40 + 12345  # beyond 32 bits: the whole Philox key is used


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Identical bits: dtype, shape, NaN positions, values and signed zeros."""
    a, b = a.cpu(), b.cpu()
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(torch.isnan(a), torch.isnan(b))
    a0 = torch.where(torch.isnan(a), torch.zeros_like(a), a)
    b0 = torch.where(torch.isnan(b), torch.zeros_like(b), b)
    assert torch.equal(a0, b0) and torch.equal(torch.signbit(a0), torch.signbit(b0))


def _same_format(gpu: FormatTensor, ref: FormatTensor) -> None:
    assert gpu.codes.is_cuda and gpu.scales.is_cuda
    assert (gpu.cols, gpu.scheme, gpu.elem, gpu.group_size) == (ref.cols, ref.scheme, ref.elem, ref.group_size)
    _same(gpu.codes, ref.codes)
    _same(gpu.scales, ref.scales)
    assert (gpu.tensor_scales is None) == (ref.tensor_scales is None)
    if ref.tensor_scales is not None:
        assert gpu.tensor_scales.is_cuda
        _same(gpu.tensor_scales, ref.tensor_scales)


def _quantize(
    x: torch.Tensor,
    scheme: str,
    elem: str,
    rule: str,
    gs: int,
    rows: int,
    stochastic: bool,
    impl: str | None = None,
    seed: int = SEED,
) -> FormatTensor:
    """``format_ops.quantize_<scheme>`` of ``x`` (by its device, or ``impl``)."""
    kw = dict(rows=rows, stochastic=stochastic, seed=seed, impl=impl)
    if scheme == "fp8":
        return format_ops.quantize_fp8(x, elem, gs, **kw)
    if scheme == "mx":
        return format_ops.quantize_mx(x, elem, scale_rule=rule, **kw)
    return format_ops.quantize_nvfp4(x, **kw)


def _to_cuda(q: FormatTensor) -> FormatTensor:
    t = None if q.tensor_scales is None else q.tensor_scales.cuda()
    return FormatTensor(q.codes.cuda(), q.scales.cuda(), t, q.cols, q.scheme, q.elem, q.group_size)


def test_cuda_tensors_dispatch_to_the_triton_kernels() -> None:
    for name in (
        "quantize_fp8",
        "quantize_mx",
        "quantize_nvfp4",
        "dequantize_fp8",
        "dequantize_mx",
        "dequantize_nvfp4",
    ):
        assert format_ops.implementation(name, torch.device("cuda")) is getattr(triton_formats, name)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("shape, stochastic", ROUNDINGS)
@pytest.mark.parametrize("scheme,elem,rule,gs", SCHEME_CASES, ids=str)
def test_formats_on_cuda_bit_exact(scheme, elem, rule, gs, shape, dtype, stochastic) -> None:
    dims, rows = SHAPES[shape]
    x = format_inputs(dims, dtype, seed=len(elem), huge=useful_huge(scheme, rows))
    q = _quantize(x.cuda(), scheme, elem, rule, gs, rows, stochastic)
    ref = _quantize(x, scheme, elem, rule, gs, rows, stochastic, impl="reference")
    _same_format(q, ref)
    for out_dtype in DTYPES.values():
        got = format_ops.dequantize_format(q, dtype=out_dtype)
        assert got.is_cuda
        _same(got, format_ops.dequantize_format(ref, dtype=out_dtype, impl="reference"))


@pytest.mark.parametrize("scheme,elem,rule,gs", SCHEME_CASES, ids=str)
def test_crafted_codes_on_cuda_bit_exact(scheme, elem, rule, gs) -> None:
    """Every code byte and every scale code a received buffer may hold (NaN and Inf codes, E8M0
    0 and 255, E4M3 NaN scales, subnormal and huge fp32 scales) decodes as the reference does."""
    g = torch.Generator().manual_seed(3)
    q = _quantize(torch.zeros(8, 1024), scheme, elem, rule, gs, 8, False, impl="reference")
    codes = torch.randint(0, 256, q.codes.shape, generator=g, dtype=torch.uint8)
    codes[0, :256] = torch.arange(256, dtype=torch.uint8)  # every byte (two or 4/3 codes each)
    if scheme == "fp8":
        some = torch.tensor([1.0, -(2.0**-140), float("nan"), 3.0e38, float("inf"), 0.0, -5.0, 2.0**-126])
        scales = some[torch.arange(q.scales.numel()) % 8].view(q.scales.shape)
    else:  # every E8M0 / E4M3 scale code (8 rows hold at least 256 blocks)
        scales = (torch.arange(q.scales.numel()) % 256).to(torch.uint8).view(q.scales.shape)
    t = torch.tensor([[2.0**-130], [7.5], [1e30], [0.0], [1.0], [2.0**-149], [3.0e38], [0.5]])
    t = t if scheme == "nvfp4" else None
    crafted = FormatTensor(codes, scales, t, q.cols, scheme, elem, gs)
    for dtype in DTYPES.values():
        _same(
            format_ops.dequantize_format(_to_cuda(crafted), dtype=dtype),
            format_ops.dequantize_format(crafted, dtype=dtype, impl="reference"),
        )


def test_stochastic_streams_differ_by_seed_on_cuda() -> None:
    """The seed reaches every GPU quantizer: two seeds, two roundings; one seed, one rounding."""
    x = (torch.randn(4099, generator=torch.Generator().manual_seed(0)) * 3).cuda()
    for scheme, elem, rule, gs in SCHEME_CASES:
        a, b, c = (_quantize(x, scheme, elem, rule, gs, 1, True, seed=s) for s in (1, 2, 1))
        assert not torch.equal(a.codes, b.codes) and torch.equal(a.codes, c.codes)
