"""Every kernel family on CUDA (the compiled Triton kernels, not the interpreter) against the torch
reference of ``kernels/reference.py``, bit for bit: same codes, same scales, same output bits.

Sizes 1, 7, 17x257 (as one row and as 17 rows) and 2**20 + 3; fp32/bf16/fp16; INT8/INT4; round
to nearest and stochastic. The reference runs on CPU copies of the same inputs, so a difference
in the GPU's arithmetic (fused multiply-add, flushed subnormals, a different Philox stream) shows
up as a failure. Outputs must also stay on the input's device.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernel_helpers import stack
from zeropp.kernels import QuantizedTensor, dequantize, dequantize_sum, dequantize_sum_requantize, quantize
from zeropp.kernels.reference import dequantize_ref, dequantize_sum_ref, dequantize_sum_requantize_ref, quantize_ref

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# (shape, rows): a lone element, less than a block, one row of 17*257, 17 rows of 257, and a large odd row
SHAPES = {
    "1": ((1,), 1),
    "7": ((7,), 1),
    "17x257": ((17, 257), 1),
    "17rows": ((17, 257), 17),
    "2**20+3": ((2**20 + 3,), 1),
}
GROUP_SIZES = (64, 100)  # 64 does not divide 257; 100 is not a power of two
SEED = 2**40 + 12345  # beyond 32 bits: the whole Philox key is used


def _data(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3
    flat = x.view(-1)
    flat[::101] = 0.0  # exact zeros inside blocks
    if flat.numel() > 600:
        flat[300:400] = 0.0  # a whole zero block (scale 0)
        flat[500] = float("inf")  # a non-finite block (scale NaN)
    return x.to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Identical bits: dtype, shape, NaN positions, values and signed zeros."""
    a, b = a.cpu(), b.cpu()
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(torch.isnan(a), torch.isnan(b))
    a0 = torch.where(torch.isnan(a), torch.zeros_like(a), a)
    b0 = torch.where(torch.isnan(b), torch.zeros_like(b), b)
    assert torch.equal(a0, b0) and torch.equal(torch.signbit(a0), torch.signbit(b0))


def _same_q(gpu: QuantizedTensor, ref: QuantizedTensor) -> None:
    assert gpu.codes.is_cuda and gpu.scales.is_cuda
    assert (gpu.cols, gpu.bits, gpu.group_size) == (ref.cols, ref.bits, ref.group_size)
    _same(gpu.codes, ref.codes)
    _same(gpu.scales, ref.scales)


def _to(q: QuantizedTensor, device: str) -> QuantizedTensor:
    return QuantizedTensor(q.codes.to(device), q.scales.to(device), q.cols, q.bits, q.group_size)


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_quantize_dequantize_on_cuda_bit_exact(shape: str, dtype: torch.dtype, bits: int, stochastic: bool) -> None:
    dims, rows = SHAPES[shape]
    for gs in GROUP_SIZES:
        x = _data(dims, dtype)
        q = quantize(x.cuda(), bits, gs, rows=rows, stochastic=stochastic, seed=SEED)
        ref = quantize_ref(x, bits, gs, rows=rows, stochastic=stochastic, seed=SEED)
        _same_q(q, ref)
        for out_dtype in DTYPES.values():
            got = dequantize(q, dtype=out_dtype)
            assert got.is_cuda
            _same(got, dequantize_ref(ref, dtype=out_dtype))
        out = torch.empty(x.numel(), dtype=dtype, device="cuda")  # into a caller buffer, its dtype wins
        dequantize(q, out=out)
        _same(out, dequantize_ref(ref, dtype=dtype).view(-1))


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("in_bits,out_bits", [(8, 8), (8, 4), (4, 4), (4, 8)])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_reductions_on_cuda_bit_exact(shape: str, in_bits: int, out_bits: int, stochastic: bool) -> None:
    """dequantize_sum and the fused dequantize-sum-requantize of k = 3 stacked inputs, from
    inputs in every dtype (the reference quantizes each on CPU; the GPU gets the same codes)."""
    dims, rows = SHAPES[shape]
    gs = 64
    for i, dtype in enumerate(DTYPES.values()):
        refs = [quantize_ref(_data(dims, dtype, seed=10 * i + s), in_bits, gs, rows=rows) for s in range(3)]
        ref = stack(refs)
        q = _to(ref, "cuda")
        for out_dtype in DTYPES.values():
            got = dequantize_sum(q, dtype=out_dtype)
            assert got.is_cuda
            _same(got, dequantize_sum_ref(ref, dtype=out_dtype))
        q2 = dequantize_sum_requantize(q, out_bits, gs, stochastic=stochastic, seed=SEED + i)
        _same_q(q2, dequantize_sum_requantize_ref(ref, out_bits, gs, stochastic=stochastic, seed=SEED + i))


def test_stochastic_streams_differ_by_seed_on_cuda() -> None:
    """The seed really reaches the GPU kernel: two seeds, two roundings; one seed, one rounding."""
    x = _data((4099,), torch.float32).cuda()
    a = quantize(x, 4, 64, stochastic=True, seed=1)
    b = quantize(x, 4, 64, stochastic=True, seed=2)
    c = quantize(x, 4, 64, stochastic=True, seed=1)
    assert not torch.equal(a.codes, b.codes) and torch.equal(a.codes, c.codes)


def _views(buf: torch.Tensor, offset: int, rows: int, cols: int, bits: int, gs: int) -> QuantizedTensor:
    """Codes then (4-byte aligned) scales as views into the byte buffer ``buf`` from ``offset``."""
    from zeropp.kernels import num_groups, row_bytes

    rb, g = row_bytes(cols, bits, gs), num_groups(cols, gs)
    codes = buf[offset : offset + rows * rb].view(torch.int8 if bits == 8 else torch.uint8).view(rows, rb)
    start = offset + rows * rb
    start += -start % 4
    return QuantizedTensor(codes, buf[start : start + 4 * rows * g].view(torch.float32).view(rows, g), cols, bits, gs)


@pytest.mark.parametrize("bits", [8, 4])
def test_bound_launches_on_cuda_bit_exact(bits: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Repeated calls of one shape take the directly launched (bound) kernel; outputs at 16-byte
    aligned and unaligned offsets of a send buffer, and seeds of each Triton int specialisation
    (1, a multiple of 16, beyond 32 bits), must each get their own binding and stay bit-exact."""
    from zeropp.kernels import _triton

    monkeypatch.setattr(_triton, "DIRECT_LAUNCH", True)  # the default path, whatever the environment says
    rows, cols, gs = 3, 1000, 64
    x = _data((rows, cols), torch.bfloat16)
    buf = torch.zeros(1 << 16, dtype=torch.uint8, device="cuda")
    for seed in (1, 2, 16, 2**40, 2**40 + 1, 2):
        for offset in (0, 3, 16, 3):
            for _ in range(2):
                out = _views(buf, offset, rows, cols, bits, gs)
                assert quantize(x.cuda(), bits, gs, rows=rows, stochastic=True, seed=seed, out=out) is out
                _same_q(out, quantize_ref(x, bits, gs, rows=rows, stochastic=True, seed=seed))
                y = torch.empty(rows * cols + 1, dtype=torch.bfloat16, device="cuda")[1:]  # 2-byte aligned
                dequantize(out, out=y)
                _same(y.view(rows, cols), dequantize_ref(_to(out, "cpu"), dtype=torch.bfloat16))
    refs = stack([quantize_ref(_data((rows, cols), torch.float32, seed=s), bits, gs, rows=rows) for s in range(3)])
    for offset in (0, 5):
        out = _views(buf, offset, rows, cols, 4, gs)
        assert dequantize_sum_requantize(_to(refs, "cuda"), 4, gs, stochastic=True, seed=9, out=out) is out
        _same_q(out, dequantize_sum_requantize_ref(refs, 4, gs, stochastic=True, seed=9))
