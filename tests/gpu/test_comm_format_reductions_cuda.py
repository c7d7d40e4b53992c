"""The float-format codecs' fused reductions on CUDA (``triton_format_reduce``, compiled, not the
interpreter) against their specification, the codecs' generic path on CPU copies of the same wire
rows, bit for bit: every element format and MX scale rule, k = 1, 2, 4, 7, rows shorter than a
block, rows ending inside one and rows of many tiles, fp32 / bf16 / fp16 sums, nearest and
stochastic re-encoding at every width of the scheme, awkward inputs and crafted wire bytes. The
calls go through ``FormatCodec``, so CUDA rows must also be dispatched to the Triton kernels."""

from __future__ import annotations

import pytest
import torch

from tests.codec_cases import spec_id
from tests.format_reduce_helpers import FORMAT_SPECS, crafted_rows, out_widths, received
from zeropp.comm.codec_base import generic_sum_requantize
from zeropp.comm.codecs import Codec, codec_for
from zeropp.comm.format_codecs import FormatCodec
from zeropp.comm.spec import QuantSpec
from zeropp.kernels import triton_format_reduce

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CASES = [((1, 1), 7), ((1, 7), 2), ((17, 257), 4), ((3, 70001), 1), ((2, 5000), 7)]
"""((rows, cols), k) of the received rows."""


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Identical bits: dtype, shape, NaN positions, values and signed zeros."""
    a, b = a.cpu(), b.cpu()
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(torch.isnan(a), torch.isnan(b))
    a0, b0 = torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0)
    assert torch.equal(a0, b0) and torch.equal(torch.signbit(a0), torch.signbit(b0))


def _check(codec: FormatCodec, buf: torch.Tensor, cols: int, spec: QuantSpec) -> None:
    bits, gs = spec.bits, spec.group_size
    dev = buf.cuda()
    assert codec._fused(dev) is triton_format_reduce
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        _same(
            codec.dequantize_sum(dev, cols, bits, gs, dtype=dtype),
            Codec.dequantize_sum(codec, buf, cols, bits, gs, dtype=dtype),
        )
    for out_bits in out_widths(spec):
        for seed in (None, 2**40 + 5):
            got = codec.dequantize_sum_requantize(dev, cols, bits, gs, out_bits=out_bits, seed=seed)
            want = generic_sum_requantize(codec, buf, cols, bits, gs, out_bits=out_bits, seed=seed)
            assert got.is_cuda and torch.equal(got.cpu(), want), (out_bits, seed)


@pytest.mark.parametrize("spec", FORMAT_SPECS, ids=spec_id)
def test_fused_sums_on_cuda_are_the_generic_sums(spec: QuantSpec) -> None:
    codec = codec_for(spec)
    assert isinstance(codec, FormatCodec)
    for i, ((rows, cols), k) in enumerate(CASES):
        _check(codec, received(codec, spec, k, rows, cols, seed=i), cols, spec)
    _check(codec, crafted_rows(codec, spec.bits, 3, 5, 257, spec.group_size, seed=1), 257, spec)
