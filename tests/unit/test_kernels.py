"""Properties of the quantization format through the public API (torch reference, the spec), its
input checks, the CPU dispatch, and a smoke run of the kernel benchmark.

The Triton kernels are compared with this reference bit for bit in test_kernels_triton.py; the
properties checked here therefore hold for both.

Here: the one-process checks of this topic; its other tiers' checks are in ``tests/e2e/test_kernels.py``.
"""

from __future__ import annotations

import importlib
import math
import struct

import pytest
import torch

from tests.kernel_helpers import (
    COMPILED_SHAPES,
    DTYPES,
    assert_bit_identical,
    assert_same_bits,
    awkward,
    compiled_path,  # noqa: F401  (a fixture, used by name)
    gaussian,
    stack,
    use_cpu_path,
)
from tests.triton_helpers import interpreted
from zeropp.kernels import (
    QuantizedTensor,
    dequantize,
    dequantize_sum,
    dequantize_sum_requantize,
    quantize,
    quantized_nbytes,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def per_element_scale(q: QuantizedTensor) -> torch.Tensor:
    """scales [rows, groups] -> [rows, cols]: the scale each element was quantized with."""
    return q.scales.repeat_interleave(q.group_size, dim=-1)[..., : q.cols]


def sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double().flatten(), y.double().flatten()
    return 10 * math.log10(x.pow(2).sum().item() / (x - y).pow(2).sum().item())


# ---------------------------------------------------------------------------------------------
# Round trip, noise floor
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group_size", [2, 100, 128, 2048])
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_within_half_a_step(bits, group_size, dtype):
    x = gaussian(17 * 257, seed=bits + group_size, dtype=dtype).view(17, 257)
    q = quantize(x, bits, group_size, rows=17)
    assert q.codes.shape == (17, q.codes.shape[-1]) and q.cols == 257
    xf = x.float()
    err = (xf - dequantize(q)).abs()  # [17, 257]
    scale = per_element_scale(q)
    # half a step, plus fp32 rounding of x/scale and code*scale (a few ulps of |x|)
    assert (err <= scale / 2 + 4e-7 * xf.abs() + 1e-30).all()


@pytest.mark.parametrize(
    "bits,group_size,stochastic,floor_db",
    # measured on this data (seed 0, 2**16 samples): 43.8, 42.6, 40.8, 18.6, 17.4, 15.6 dB
    [
        (8, 128, False, 42.0),
        (8, 512, False, 41.0),
        (8, 128, True, 39.0),
        (4, 128, False, 17.0),
        (4, 512, False, 16.0),
        (4, 128, True, 14.0),
    ],
)
def test_sqnr_floor_on_gaussian_data(bits, group_size, stochastic, floor_db):
    x = gaussian(1 << 16)
    y = dequantize(quantize(x, bits, group_size, stochastic=stochastic, seed=1))
    assert sqnr_db(x, y) >= floor_db


def test_smaller_blocks_keep_error_local():
    """Why block-wise scales: an outlier only coarsens its own block."""
    x = gaussian(1 << 14)
    x[7] = 1000.0
    fine = sqnr_db(x, dequantize(quantize(x, 8, 64)))
    coarse = sqnr_db(x, dequantize(quantize(x, 8, 1 << 14)))
    assert fine > coarse + 10


# ---------------------------------------------------------------------------------------------
# Special blocks
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_block_gives_zeros_and_zero_scale(bits, dtype):
    x = gaussian(5 * 64, dtype=dtype)
    x[64:128] = 0
    q = quantize(x, bits, 64)
    assert q.scales[0, 1] == 0
    y = dequantize(q, dtype=dtype).view(-1)
    assert torch.equal(y[64:128], torch.zeros(64, dtype=dtype))
    assert torch.isfinite(y).all()
    assert torch.equal(dequantize(quantize(torch.zeros(10, dtype=dtype), bits, 4)), torch.zeros(1, 10))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_block_dequantizes_to_nan_and_neighbours_survive(bits, bad, dtype):
    x = gaussian(4 * 32 + 5, dtype=dtype)  # 5 blocks, the last one partial
    x[40] = bad
    q = quantize(x, bits, 32)
    assert torch.isnan(q.scales[0, 1]) and torch.isfinite(q.scales[0, [0, 2, 3, 4]]).all()
    y = dequantize(q, dtype=dtype).view(-1)
    assert torch.isnan(y[32:64]).all()
    ok = torch.cat([y[:32], y[64:]]).float()
    ref = torch.cat([x[:32], x[64:]]).float()
    assert torch.isfinite(ok).all() and (ok - ref).abs().max() < 0.6  # INT4 step on N(0,1) < 1.2


def test_non_finite_block_codes_are_zero():
    x = torch.ones(8)
    x[3] = float("nan")
    assert torch.equal(quantize(x, 8, 8).codes, torch.zeros(1, 8, dtype=torch.int8))
    assert torch.equal(quantize(x, 4, 8).codes, torch.full((1, 4), 0x88, dtype=torch.uint8))


# ---------------------------------------------------------------------------------------------
# Layout: sizes, packing, byte accounting
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 7, 257, 2**20 + 3])
@pytest.mark.parametrize("bits", [8, 4])
def test_any_element_count_pads_internally(n, bits):
    q = quantize(gaussian(n), bits, 128)
    assert q.nbytes == quantized_nbytes(1, n, bits, 128)
    assert dequantize(q).shape == (1, n)


def test_int4_packing_order():
    """Element 2i in the low nibble, 2i+1 in the high nibble, each stored as code + 8."""
    x = torch.tensor([7.0, -7.0, 1.0, 0.0])
    assert quantize(x, 4, 4).codes.tolist() == [[(8 + 7) | ((8 - 7) << 4), (8 + 1) | (8 << 4)]]


# ---------------------------------------------------------------------------------------------
# out= buffers and output dtypes
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [8, 4])
def test_out_buffer_written_in_place(dtype, bits):
    x = gaussian(3 * 100).view(3, 100)
    q = quantize(x, bits, 64, rows=3)
    out = torch.full((300,), 123.0, dtype=dtype)
    ptr = out.data_ptr()
    res = dequantize(q, out=out, dtype=torch.float32)  # the buffer's dtype wins
    assert res is out and out.data_ptr() == ptr
    assert torch.equal(out.view(3, 100), dequantize(q, dtype=dtype))
    assert torch.equal(dequantize(q, dtype=dtype), dequantize(q).to(dtype))


# ---------------------------------------------------------------------------------------------
# Stochastic rounding
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [8, 4])
def test_stochastic_rounding_is_unbiased(bits):
    x = gaussian(2048, seed=3)
    seeds = 256
    mean = sum(dequantize(quantize(x, bits, 128, stochastic=True, seed=s)) for s in range(seeds)) / seeds
    nearest_err = (dequantize(quantize(x, bits, 128)) - x).abs().mean()
    stoch_err = (mean - x).abs().mean()
    # each element's error is zero-mean with std <= step/2: the average over 256 seeds shrinks it 16x
    assert stoch_err < nearest_err / 4
    step = per_element_scale(quantize(x, bits, 128))
    assert ((mean - x).abs() <= 6 * step / (2 * seeds**0.5)).all()


def test_stochastic_rounding_is_deterministic_per_seed():
    x = gaussian(1000)
    a, b = quantize(x, 4, 64, stochastic=True, seed=5), quantize(x, 4, 64, stochastic=True, seed=5)
    c = quantize(x, 4, 64, stochastic=True, seed=6)
    assert torch.equal(a.codes, b.codes) and not torch.equal(a.codes, c.codes)
    err = (dequantize(a) - x).abs()
    assert (err < per_element_scale(a) * (1 + 1e-6)).all()  # within one step, never more


def philox4x32_10_py(counter: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, int, int, int]:
    """Philox4x32-10 from its definition (Salmon et al., "Parallel random numbers: as easy as 1,
    2, 3", SC'11), in Python integers: ten rounds of two 32x32 -> 64-bit products with the
    multipliers 0xD2511F53 and 0xCD9E8D57, the key bumped by the Weyl constants after each."""
    m = 0xFFFFFFFF
    x0, x1, x2, x3 = counter
    k0, k1 = key
    for _ in range(10):
        p0, p1 = 0xD2511F53 * x0, 0xCD9E8D57 * x2
        x0, x1, x2, x3 = (p1 >> 32) ^ x1 ^ k0, p1 & m, (p0 >> 32) ^ x3 ^ k1, p0 & m
        k0, k1 = (k0 + 0x9E3779B9) & m, (k1 + 0xBB67AE85) & m
    return x0, x1, x2, x3


def test_the_python_philox_gives_the_published_answers():
    # Random123's known-answer vectors of philox4x32 with 10 rounds
    assert philox4x32_10_py((0, 0, 0, 0), (0, 0)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    ones = 0xFFFFFFFF
    assert philox4x32_10_py((ones,) * 4, (ones, ones)) == (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)
    pi = (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344)
    assert philox4x32_10_py(pi, (0xA4093822, 0x299F31D0)) == (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)


def uniform_bits_py(w: int) -> int:
    """Triton's uint32 -> uniform conversion (``tl.rand``'s) in Python: the word as int32, ``~x``
    for negatives, times 4.6566127342e-10, each value rounded to fp32; the result's fp32 bits."""

    def f32(v: float) -> float:
        return struct.unpack("<f", struct.pack("<f", v))[0]

    x = w - 2**32 if w >= 2**31 else w
    x = ~x if x < 0 else x
    return struct.unpack("<I", struct.pack("<f", f32(f32(x) * f32(4.6566127342e-10))))[0]


@pytest.mark.parametrize("seed", [0, 0x1234_5678_9ABC_DEF0])
@pytest.mark.parametrize("first", [0, 4 * (2**32 + 3)])  # counters of one word, and of both words
def test_the_stochastic_stream_is_word_o_mod_4_of_philox_at_counter_o_div_4(seed, first):
    """The stream every stochastic codec draws (``reference.philox_uniform``, which the Triton and
    native kernels match bit for bit): offsets ``first .. first + 7`` are the four words of the
    counters ``first // 4`` and ``first // 4 + 1``, in order."""
    from zeropp.kernels.reference import philox_uniform

    m = 0xFFFFFFFF
    want = []
    for ctr in (first // 4, first // 4 + 1):
        words = philox4x32_10_py((ctr & m, ctr >> 32, 0, 0), (seed & m, seed >> 32))
        want += [uniform_bits_py(w) for w in words]
    got = philox_uniform(seed, first + torch.arange(8, dtype=torch.int64))
    assert got.view(torch.int32).tolist() == [w - 2**32 if w >= 2**31 else w for w in want]


# ---------------------------------------------------------------------------------------------
# Reductions
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 3, 4])
@pytest.mark.parametrize("bits", [8, 4])
def test_dequantize_sum_is_ordered_fp32_sum(k, bits):
    qs = [quantize(gaussian(2 * 300, seed=i), bits, 128, rows=2) for i in range(k)]
    acc = torch.zeros(2, 300)
    for q in qs:
        acc = acc + dequantize(q)
    assert torch.equal(dequantize_sum(stack(qs)), acc)
    out = torch.empty(600, dtype=torch.bfloat16)
    assert dequantize_sum(stack(qs), out=out) is out and torch.equal(out.view(2, 300), acc.bfloat16())


@pytest.mark.parametrize("k", [1, 3, 4])
@pytest.mark.parametrize("in_bits,out_bits", [(8, 8), (4, 4), (8, 4), (4, 8)])
@pytest.mark.parametrize("stochastic", [False, True])
def test_fused_requantize_equals_quantize_of_sum(k, in_bits, out_bits, stochastic):
    qs = [quantize(gaussian(3 * 257, seed=i), in_bits, 64, rows=3) for i in range(k)]
    s = stack(qs)
    fused = dequantize_sum_requantize(s, out_bits, stochastic=stochastic, seed=11)
    unfused = quantize(dequantize_sum(s), out_bits, 64, rows=3, stochastic=stochastic, seed=11)
    assert torch.equal(fused.codes, unfused.codes) and torch.equal(fused.scales, unfused.scales)


def test_reduction_propagates_non_finite_blocks():
    a, b = gaussian(256, seed=1), gaussian(256, seed=2)
    b[130] = float("inf")
    s = stack([quantize(a, 4, 128), quantize(b, 4, 128)])
    assert torch.isnan(dequantize_sum(s)[0, 128:]).all() and torch.isfinite(dequantize_sum(s)[0, :128]).all()
    r = dequantize_sum_requantize(s, 4)
    assert torch.isnan(r.scales[0, 1]) and torch.isfinite(r.scales[0, 0])


# ---------------------------------------------------------------------------------------------
# Input checks (both implementations share them) and dispatch
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=interpreted)])
def test_bad_inputs_raise_clear_value_errors(impl):
    x = gaussian(100)
    q = quantize(x, 8, 32)
    cases = [
        (lambda: quantize(x, 3, 32, impl=impl), "bits=3"),
        (lambda: quantize(x, 4, 33, impl=impl), "odd"),
        (lambda: quantize(x, 8, 0, impl=impl), "group_size"),
        (lambda: quantize(x, 8, 32, rows=3, impl=impl), "equal rows"),
        (lambda: quantize(torch.arange(10), 8, 32, impl=impl), "dtype"),
        (lambda: quantize(x, 8, 32, stochastic=True, seed=-1, impl=impl), "seed"),
        (lambda: dequantize(q, out=torch.empty(99), impl=impl), "elements"),
        (lambda: dequantize(q, out=torch.empty(100, dtype=torch.int32), impl=impl), "dtype"),
        (lambda: dequantize(q, out=torch.empty(200)[::2], impl=impl), "contiguous"),
        (lambda: dequantize(q, dtype=torch.int8, impl=impl), "dtype"),
        (lambda: dequantize_sum(q, impl=impl), r"\[k, rows"),
        (lambda: dequantize(stack([q, q]), impl=impl), r"\[rows, \*\]"),
        (lambda: dequantize_sum_requantize(stack([q]), 8, 64, impl=impl), "group_size"),
        (lambda: dequantize_sum_requantize(stack([quantize(x, 8, 33)]), 4, impl=impl), "odd"),
        (lambda: quantize(x, impl="cuda"), "impl"),
    ]
    for fn, match in cases:
        with pytest.raises(ValueError, match=match):
            fn()


def test_mismatched_quantized_tensor_is_rejected():
    q = quantize(gaussian(100), 4, 32)
    with pytest.raises(ValueError, match="layout mismatch"):
        QuantizedTensor(q.codes, q.scales, 200, 4, 32)
    with pytest.raises(ValueError, match="uint8"):
        QuantizedTensor(q.codes.view(torch.int8), q.scales, 100, 4, 32)
    with pytest.raises(ValueError, match="float32"):
        QuantizedTensor(q.codes, q.scales.double(), 100, 4, 32)
    with pytest.raises(ValueError, match="leading dims"):
        QuantizedTensor(q.codes, q.scales.expand(2, 4), 100, 4, 32)


def test_cpu_tensors_take_the_reference(monkeypatch):
    # the package re-exports functions named like its modules, so fetch the modules themselves
    qm = importlib.import_module("zeropp.kernels.quantize")
    rm = importlib.import_module("zeropp.kernels.reduce")

    def boom(*a, **k):
        raise AssertionError("Triton path taken for a CPU tensor")

    for mod, name in [
        (qm, "_quantize_triton"),
        (qm, "_dequantize_triton"),
        (rm, "_dequantize_sum_triton"),
        (rm, "_dequantize_sum_requantize_triton"),
    ]:
        monkeypatch.setattr(mod, name, boom)
    q = quantize(gaussian(100), 4, 32)
    dequantize(q)
    dequantize_sum(stack([q, q]))
    dequantize_sum_requantize(stack([q, q]), 4)


# ---------------------------------------------------------------------------------------------
# The fast CPU path (kernels/cpu.py) against the reference, bit for bit
# ---------------------------------------------------------------------------------------------


SMALL_SHAPES = [((0,), 1), ((1,), 1), ((7,), 1), ((17, 257), 17)]
LARGE_SHAPES = [((3, 70001), 3), ((2**17 + 3,), 1)]  # several tiles per row (kernels.cpu.TILE_ELEMS = 65536)
FAST_CASES = (  # (shape, rows, group_size, stochastic); stochastic large shapes once (Philox is slow)
    [(sh, r, gs, st) for sh, r in SMALL_SHAPES for gs in (2, 100, 512, 16000) for st in (False, True)]
    + [(sh, r, gs, False) for sh, r in LARGE_SHAPES for gs in (2, 100, 512, 16000)]
    + [(sh, r, 100, True) for sh, r in LARGE_SHAPES]
)


@pytest.fixture(params=["tiled", "native"])
def fast_path(request, monkeypatch):
    """The tile-boundary cases below, through the tiles and through the native kernels (which
    take every size, so these awkward shapes reach their partial blocks and padding too)."""
    use_cpu_path(monkeypatch, request.param)
    return request.param


@pytest.fixture
def native_path(monkeypatch):
    use_cpu_path(monkeypatch, "native")


@pytest.mark.usefixtures("fast_path")
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,rows,group_size,stochastic", FAST_CASES, ids=str)
def test_fast_cpu_quantize_is_bit_identical_to_the_reference(shape, rows, group_size, stochastic, dtype, bits):
    """Shapes with several tiles per row, several rows per tile, partial last blocks and a block
    bigger than a tile."""
    from zeropp.kernels.cpu import quantize_cpu
    from zeropp.kernels.reference import quantize_ref

    x = awkward(shape, dtype, seed=group_size)
    ref = quantize_ref(x, bits, group_size, rows=rows, stochastic=stochastic, seed=9)
    assert_bit_identical(quantize_cpu(x, bits, group_size, rows=rows, stochastic=stochastic, seed=9), ref)


SPECIAL_VALUES = [
    3e38,
    -1e38,
    1.0,
    70000.0,
    -65520.0,
    5.0,
    1e-40,
    -3e-39,  # huge, subnormal
    2e-45,
    0.0,
    -0.0,
    -0.0,
    -0.0,
    -0.0,
    1e-45,
    2.0,
]
"""Huge, subnormal and signed-zero values; with a group size of 4 or 2, one block is all -0.0."""


@pytest.mark.usefixtures("fast_path")
@pytest.mark.parametrize("bits", [8, 4])
def test_fast_cpu_quantize_special_values_and_strides(bits):
    from zeropp.kernels.cpu import quantize_cpu
    from zeropp.kernels.reference import quantize_ref

    x = torch.tensor(SPECIAL_VALUES)
    for gs in (2, 4):
        assert_bit_identical(quantize_cpu(x, bits, gs), quantize_ref(x, bits, gs))
    t = gaussian(64 * 34).view(64, 34).t()  # non-contiguous
    assert_bit_identical(quantize_cpu(t, bits, 16, rows=34), quantize_ref(t, bits, 16, rows=34))


@pytest.mark.usefixtures("fast_path")
@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("in_bits,out_bits", [(8, 4), (4, 8), (4, 4), (8, 8)])
@pytest.mark.parametrize("stochastic", [False, True])
def test_fast_cpu_requantize_is_bit_identical_to_the_reference(k, in_bits, out_bits, stochastic):
    from zeropp.kernels.cpu import dequantize_sum_requantize_cpu
    from zeropp.kernels.reference import dequantize_sum_requantize_ref

    qs = [quantize(awkward((3, 401), torch.float32, seed=i), in_bits, 64, rows=3) for i in range(max(k, 1))]
    s = stack(qs)
    s = QuantizedTensor(s.codes[:k], s.scales[:k], s.cols, s.bits, s.group_size)
    want = dequantize_sum_requantize_ref(s, out_bits, 64, stochastic=stochastic, seed=4)
    assert_bit_identical(dequantize_sum_requantize_cpu(s, out_bits, 64, stochastic=stochastic, seed=4), want)


@pytest.mark.usefixtures("fast_path")
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(
    "shape,rows,group_size",
    [
        ((0,), 1, 64),
        ((7,), 1, 2),
        ((17, 257), 17, 100),
        ((3, 70001), 3, 512),
        ((2**17 + 3,), 1, 2),
        ((5, 300), 5, 16000),
    ],
    ids=str,
)
def test_fast_cpu_dequantize_and_sums_are_bit_identical_to_the_reference(shape, rows, group_size, bits):
    from zeropp.kernels.cpu import dequantize_cpu, dequantize_sum_cpu
    from zeropp.kernels.reference import dequantize_ref, dequantize_sum_ref

    qs = [quantize(awkward(shape, torch.float32, seed=i), bits, group_size, rows=rows) for i in range(4)]
    for k in (0, 1, 2, 3, 4):
        s = stack(qs)
        s = QuantizedTensor(s.codes[:k], s.scales[:k], s.cols, s.bits, s.group_size)
        for dtype in DTYPES:
            assert_same_bits(dequantize_sum_cpu(s, dtype=dtype), dequantize_sum_ref(s, dtype=dtype))
    for dtype in DTYPES:
        assert_same_bits(dequantize_cpu(qs[0], dtype=dtype), dequantize_ref(qs[0], dtype=dtype))
        out = torch.full((math.prod(shape),), 7.0, dtype=dtype)
        assert dequantize_cpu(qs[1], out=out) is out
        assert_same_bits(out, dequantize_ref(qs[1], dtype=dtype).view(-1))


# ---------------------------------------------------------------------------------------------
# The compiled CPU kernels (kernels/cpu_fused.py) against the reference, bit for bit. Each
# (op, dtype, bits, group size, k) variant compiles once per process, so the matrix is kept small:
# every dtype and bit width at one group size, the rest on fp32.
# ---------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("compiled_path")
@pytest.mark.parametrize("bits", [8, 4])
def test_compiled_cpu_quantize_special_values(bits):
    from zeropp.kernels.cpu import quantize_cpu
    from zeropp.kernels.reference import quantize_ref

    x = torch.tensor(SPECIAL_VALUES)
    assert_bit_identical(quantize_cpu(x, bits, 2), quantize_ref(x, bits, 2))


def test_compiled_cpu_failure_warns_and_falls_back_to_the_tiles(monkeypatch):
    from zeropp.kernels import cpu, cpu_fused
    from zeropp.kernels.reference import quantize_ref

    def broken(*args):
        raise RuntimeError("no C++ compiler")

    use_cpu_path(monkeypatch, "compiled")  # native kernels off: the compiled path is the one that fails here
    monkeypatch.setattr(cpu_fused, "quantize_fused", broken)
    x = awkward((4, 1000), torch.float32)
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
        q = cpu.quantize_cpu(x, 8, 100, rows=4)
    assert_bit_identical(q, quantize_ref(x, 8, 100, rows=4))
    assert not cpu.fused_enabled(10**9)  # off for the rest of the process (here: of this test)


# ---------------------------------------------------------------------------------------------
# The native CPU kernels (kernels/cpu_native.py, what CPU ranks run) against the reference, bit
# for bit, beyond the tile-boundary cases above (which run through them too). One build serves
# every variant, so the matrix can be full.
# ---------------------------------------------------------------------------------------------
@pytest.mark.usefixtures("native_path")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", [8, 4])
def test_native_cpu_quantize_is_bit_identical_to_the_reference(dtype, bits):
    from zeropp.kernels.cpu import quantize_cpu
    from zeropp.kernels.reference import quantize_ref

    for shape, rows in COMPILED_SHAPES:
        for gs in (2, 100, 512):
            x = awkward(shape, dtype, seed=rows + gs)
            for stochastic, seed in ((False, 0), (True, 9), (True, 2**40 + 3)):  # a seed with a high word
                if stochastic and math.prod(shape) > 5000 and gs != 100:
                    continue  # the reference's Philox is slow; one group size covers the big shapes
                ref = quantize_ref(x, bits, gs, rows=rows, stochastic=stochastic, seed=seed)
                got = quantize_cpu(x, bits, gs, rows=rows, stochastic=stochastic, seed=seed)
                assert_bit_identical(got, ref)


@pytest.mark.usefixtures("native_path")
@pytest.mark.parametrize("bits", [8, 4])
def test_native_cpu_dequantize_rounds_like_torch_casts(bits):
    """Arbitrary scales (subnormal, huge enough to overflow bf16 / fp16, negative, -0.0, NaN, Inf)
    exercise the fp32 products and their rounding to each output dtype."""
    from zeropp.kernels.cpu import dequantize_cpu, dequantize_sum_cpu
    from zeropp.kernels.reference import dequantize_ref, dequantize_sum_ref

    g = torch.Generator().manual_seed(bits)
    rows, cols, gs = 3, 333, 16
    groups = -(-cols // gs)
    tiny = torch.finfo(torch.float32).tiny  # the smallest normal: products of a normal scale stay normal
    special = torch.tensor(
        [
            1e-40,
            -3e-39,
            1e-45,
            3e38,
            7e4,
            6.6e4,
            -1.0,
            -0.0,
            0.0,
            float("nan"),
            float("inf"),
            1.0,
            tiny,
            -tiny,
            tiny / 2,
            2.5e36,
            float("-inf"),
        ]
    )
    scales = torch.randn(2, rows, groups, generator=g) * 10.0 ** torch.randint(-42, 38, (2, rows, groups), generator=g)
    scales.view(-1)[: special.numel()] = special
    rb = groups * gs * bits // 8
    codes = torch.randint(0, 256, (2, rows, rb), dtype=torch.uint8, generator=g)
    if bits == 8:
        codes = codes.view(torch.int8)
    one = QuantizedTensor(codes[0], scales[0], cols, bits, gs)
    two = QuantizedTensor(codes, scales, cols, bits, gs)
    for dtype in DTYPES:
        assert_same_bits(dequantize_cpu(one, dtype=dtype), dequantize_ref(one, dtype=dtype))
        assert_same_bits(dequantize_sum_cpu(two, dtype=dtype), dequantize_sum_ref(two, dtype=dtype))


@pytest.mark.usefixtures("native_path")
def test_native_cpu_takes_strided_and_odd_offset_codes():
    """Stacked inputs that are views (a [rows, k, *] receive buffer transposed) and INT4 codes at
    an odd byte offset are read in place."""
    from zeropp.kernels.cpu import dequantize_cpu, dequantize_sum_cpu, dequantize_sum_requantize_cpu
    from zeropp.kernels.reference import dequantize_ref, dequantize_sum_ref, dequantize_sum_requantize_ref

    qs = [quantize(awkward((4, 1000), torch.float32, seed=i), 4, 100, rows=4) for i in range(3)]
    recv = torch.stack([q.codes for q in qs], dim=1)  # [rows, k, row_bytes]
    scales = torch.stack([q.scales for q in qs], dim=1)
    view = QuantizedTensor(recv.transpose(0, 1), scales.transpose(0, 1), 1000, 4, 100)  # [k, rows, *], strided
    dense = stack(qs)
    assert not view.codes.is_contiguous()
    assert_same_bits(dequantize_sum_cpu(view), dequantize_sum_ref(dense))
    assert_bit_identical(dequantize_sum_requantize_cpu(view, 8, 100), dequantize_sum_requantize_ref(dense, 8, 100))
    buf = torch.empty(1 + qs[0].codes.numel(), dtype=torch.uint8)
    buf[1:] = qs[0].codes.view(-1)
    odd = QuantizedTensor(buf[1:].view(qs[0].codes.shape), qs[0].scales, 1000, 4, 100)
    assert_same_bits(dequantize_cpu(odd, dtype=torch.bfloat16), dequantize_ref(qs[0], dtype=torch.bfloat16))


@pytest.mark.usefixtures("native_path")
@pytest.mark.parametrize("stochastic", [False, True])
def test_native_cpu_writes_quantized_out_in_place(stochastic):
    from zeropp.kernels.cpu import dequantize_sum_requantize_cpu, quantize_cpu
    from zeropp.kernels.reference import dequantize_sum_requantize_ref, quantize_ref

    x = awkward((17, 257), torch.bfloat16)
    ref = quantize_ref(x, 4, 100, rows=17, stochastic=stochastic, seed=3)
    sb = 4 * ref.scales.numel()
    send = torch.zeros(sb + ref.codes.numel(), dtype=torch.uint8)  # one message: scales, then codes
    out = QuantizedTensor(
        send[sb:].view(ref.codes.shape), send[:sb].view(torch.float32).view(ref.scales.shape), 257, 4, 100
    )
    assert quantize_cpu(x, 4, 100, rows=17, stochastic=stochastic, seed=3, out=out) is out
    assert_bit_identical(out, ref)
    s = stack([ref, ref])
    want = dequantize_sum_requantize_ref(s, 4, 100, stochastic=stochastic, seed=5)
    assert dequantize_sum_requantize_cpu(s, 4, 100, stochastic=stochastic, seed=5, out=out) is out
    assert_bit_identical(out, want)
    with pytest.raises(ValueError, match="out does not fit"):
        quantize_cpu(x, 8, 100, rows=17, out=out)


def test_native_cpu_failure_warns_once_and_falls_back(monkeypatch):
    from zeropp.kernels import cpu, cpu_fused, cpu_native
    from zeropp.kernels.reference import quantize_ref

    monkeypatch.setattr(cpu_native, "ENABLED", True)
    monkeypatch.setattr(cpu_native, "_LIB", None)
    monkeypatch.setattr(cpu_native, "FAILED", "RuntimeError: no C++ compiler found")
    monkeypatch.setattr(cpu, "_native_warned", False)
    monkeypatch.setattr(cpu_fused, "FUSED_MIN_ELEMS", 2**62)  # the tiles, not a compile
    x = awkward((4, 1000), torch.float32)
    with pytest.warns(RuntimeWarning, match="native CPU quantization kernels are unavailable.*no C\\+\\+ compiler"):
        q = cpu.quantize_cpu(x, 8, 100, rows=4)
    assert_bit_identical(q, quantize_ref(x, 8, 100, rows=4))
    assert not cpu.native_enabled()  # off for the rest of the process, and no second warning


def test_bench_cpu_path_switch_is_scoped():
    """--cpu-path / --vs-path route the timed calls only; the process's own settings come back."""
    from zeropp.experiments.bench import kernels as bench_kernels
    from zeropp.kernels import cpu_fused, cpu_native

    saved = cpu_native.ENABLED, cpu_fused.FUSED_MIN_ELEMS
    with bench_kernels.cpu_path("tiled"):
        assert not cpu_native.ENABLED and cpu_fused.FUSED_MIN_ELEMS == 2**62
    with bench_kernels.cpu_path("compiled"):
        assert not cpu_native.ENABLED and saved[1] == cpu_fused.FUSED_MIN_ELEMS
    assert saved == (cpu_native.ENABLED, cpu_fused.FUSED_MIN_ELEMS)
