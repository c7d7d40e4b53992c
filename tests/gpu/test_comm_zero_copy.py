"""The quantized collectives make no copies around the collective itself (issue 11, item 2).

What is proven, and how:

- parity: the ``int`` codec's in-place wire path (quantize into views of the send buffer, read
  the receive buffer through views) produces the same bytes and the same values as the generic
  pack / unpack path (``Codec``'s defaults, which are what the codec did before), on awkward
  sizes (1, 7, 17x257), fp32/bf16/fp16, INT8/INT4, round-to-nearest and stochastic, and on group
  sizes whose layout cannot be viewed in place (those keep copying, with the same bytes);
- aliasing: ``unpack`` returns views of the received buffer; the all-gather writes the caller's
  output (same ``data_ptr``), also when the output is a row-strided column slice;
- op counts: a ``TorchDispatchMode`` records every aten op the caller's thread issues during a
  quantized all-gather / reduce-scatter on gloo worlds of 2 and 2x2 ranks, with the kernels
  forced onto the Triton path (run by the interpreter on CPU). Ops issued *inside* a kernel
  launch are not counted: the interpreter emulates the kernel with host copies of its
  arguments, a GPU launch issues no aten op at all. What remains must be exactly the send and
  receive wire buffers (one allocation each, codes and scales included), the collective, and
  views: no ``copy_``, ``cat``, ``clone`` or ``contiguous`` copy, in particular no swizzled copy
  of the gradient in the hierarchical qgZ.

Here: the CUDA checks of this topic; its other tiers' checks are in ``tests/unit/test_comm_zero_copy.py``,
``tests/distributed/test_comm_zero_copy.py``.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from zeropp.comm.codecs import Codec, IntCodec

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# ----------------------------------------------------------------------------------------------
# Parity of the in-place wire path with the generic pack / unpack path (no process group needed)
# ----------------------------------------------------------------------------------------------
def _generic_encode(c: IntCodec, x: torch.Tensor, bits: int, gs: int, rows: int, seed: Optional[int]) -> torch.Tensor:
    return Codec.encode(c, x, bits, gs, rows=rows, seed=seed)  # pack(quantize(x)): the old path


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [None, 5])
def test_wire_views_on_cuda_match_the_cpu_reference(dtype, seed) -> None:
    """The compiled kernels on row-strided and swizzled views: the bytes and values of the CPU
    reference path (encode of the swizzled view, reduce of received rows through views,
    re-quantization into a wire buffer, dequantization into columns of a wider buffer)."""
    from zeropp.comm.qgz import swizzle, swizzled_view

    nodes, rpn, n = 2, 4, 17 * 257
    c = IntCodec()
    x = (torch.randn(nodes * rpn, n) * 2).to(dtype)
    for bits in (8, 4):
        want = _generic_encode(c, swizzle(x, nodes, rpn), bits, 128, nodes * rpn, seed)  # CPU
        got = c.encode(swizzled_view(x.cuda(), nodes, rpn), bits, 128, rows=nodes * rpn, seed=seed)
        assert torch.equal(got.cpu(), want)
        recv = got.view(rpn, nodes, -1)  # as hop 1 receives it: [rpn sources, nodes, B]
        s_gpu = c.dequantize_sum_requantize(recv, n, bits, 128, out_bits=4, seed=seed)
        s_cpu = c.dequantize_sum_requantize(want.view(rpn, nodes, -1), n, bits, 128, out_bits=4, seed=seed)
        assert torch.equal(s_gpu.cpu(), s_cpu)
        out = torch.zeros(1, n, dtype=dtype, device="cuda")
        c.dequantize_sum(s_gpu.unsqueeze(1), n, 4, 128, out=out)
        assert torch.equal(out.cpu(), c.dequantize_sum(s_cpu.unsqueeze(1), n, 4, 128, dtype=dtype))
        wide = torch.zeros(nodes * rpn, n + 30, dtype=dtype, device="cuda")
        c.dequantize(c.unpack(got, n, bits, 128), out=wide[:, 10 : 10 + n])
        ref = c.dequantize(c.unpack(want, n, bits, 128), dtype=dtype)
        assert torch.equal(wide[:, 10 : 10 + n].cpu(), ref) and not wide[:, :10].any() and not wide[:, 10 + n :].any()
