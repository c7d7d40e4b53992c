"""The compiled Hadamard kernel on a GPU against the torch reference, bit for bit (the CPU tests
run it under the interpreter), and the rotated codec on CUDA tensors. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_helpers import DTYPES, assert_same_bits

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("shape, rows", [((1,), 1), ((7,), 1), ((17, 257), 1), ((17, 257), 17), ((3, 1 << 20), 3)])
@pytest.mark.parametrize("block", [2, 8, 128, 512, 4096])
@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_kernel_matches_reference_bit_for_bit(shape, rows, block, dtype) -> None:
    from zeropp.kernels import hadamard
    from zeropp.kernels.reference import hadamard_ref

    g = torch.Generator().manual_seed(block)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    cols = x.numel() // rows
    for out_dtype in {torch.float32, dtype}:
        got = hadamard(x.cuda(), block, rows=rows, dtype=out_dtype)
        assert got.is_cuda
        assert_same_bits(got.cpu(), hadamard_ref(x, block, rows=rows, dtype=out_dtype))
    rot = hadamard_ref(x, block, rows=rows)
    assert_same_bits(
        hadamard(rot.cuda(), block, rows=rows, out_cols=cols, dtype=dtype).cpu(),
        hadamard_ref(rot, block, rows=rows, out_cols=cols, dtype=dtype),
    )


def test_rotated_codec_on_cuda_matches_cpu() -> None:
    from zeropp.comm.codecs import codec_for
    from zeropp.comm.spec import QuantSpec

    c = codec_for(QuantSpec(bits=4, group_size=128, rotation="hadamard"))
    x = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0))
    for seed in (None, 3):
        buf = c.encode(x.cuda(), 4, 128, rows=4, seed=seed)
        assert torch.equal(buf.cpu(), c.encode(x, 4, 128, rows=4, seed=seed))
        out = c.dequantize(c.unpack(buf, 1000, 4, 128), dtype=torch.bfloat16)
        want = c.dequantize(c.unpack(buf.cpu(), 1000, 4, 128), dtype=torch.bfloat16)
        assert out.is_cuda and torch.equal(out.cpu(), want)
        stacked = torch.stack([buf, buf])
        assert torch.equal(c.dequantize_sum(stacked, 1000, 4, 128).cpu(), c.dequantize_sum(stacked.cpu(), 1000, 4, 128))
