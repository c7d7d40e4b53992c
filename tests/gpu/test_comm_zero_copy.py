"""The quantized collectives make no copies around the collective itself.

Here: the CUDA checks. The topic's full description and its gloo-world checks are in
``tests/distributed/test_comm_zero_copy.py``; its one-process checks are in
``tests/unit/test_comm_zero_copy.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.comm_helpers import generic_encode
from tests.kernel_helpers import DTYPES
from zeropp.comm.codecs import IntCodec

# ----------------------------------------------------------------------------------------------
# Parity of the in-place wire path with the generic pack / unpack path (no process group needed)
# ----------------------------------------------------------------------------------------------


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
        want = generic_encode(c, swizzle(x, nodes, rpn), bits, 128, nodes * rpn, seed)  # CPU
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
