"""The Triton kernels against the torch reference, bit for bit (same scales, same codes, same
output bits), run on CPU tensors under TRITON_INTERPRET=1 (set by conftest.py).

The interpreter costs about 1 s per million elements per kernel, so the 2**20 + 3 cases are kept
to two; everything else is small but chosen to hit every masking path: sizes smaller than one
block, group sizes that do not divide the row, non-power-of-two group sizes, several tiles per
row, several rows, NaN/Inf/zero blocks, and all dtype/bit-width combinations.

Here: the one-process checks of this topic; its other tiers' checks are in
``tests/e2e/test_kernels_triton.py``.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from tests.kernel_helpers import DTYPES, SHAPES, assert_same_bits, data, stack
from tests.triton_helpers import interpreted
from zeropp.kernels import QuantizedTensor, dequantize, dequantize_sum, dequantize_sum_requantize, quantize
from zeropp.kernels._triton import HAS_TRITON, stochastic_uniform
from zeropp.kernels.reference import philox_uniform

pytestmark = [
    pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed"),
    interpreted,
    pytest.mark.usefixtures("one_torch_thread"),
]

# 2: many blocks per tile and >1 tile per row; 64: does not divide 257; 100: not a power of two;
# 2048: one block larger than the whole row
GROUP_SIZES = [2, 64, 100, 2048]


def assert_same_q(a: QuantizedTensor, b: QuantizedTensor) -> None:
    """Same layout, same codes, same scales (NaN scales compared by position)."""
    assert (a.cols, a.bits, a.group_size) == (b.cols, b.bits, b.group_size)
    assert a.codes.dtype == b.codes.dtype and torch.equal(a.codes, b.codes)
    assert_same_bits(a.scales, b.scales)


def test_assert_same_bits_tells_inf_from_the_largest_finite_value():
    """The overflow tests below compare outputs that are +-inf; the comparison must see them."""
    for dtype in DTYPES:
        big = torch.finfo(dtype).max
        with pytest.raises(AssertionError):
            assert_same_bits(torch.tensor([float("inf")], dtype=dtype), torch.tensor([big], dtype=dtype))
        with pytest.raises(AssertionError):
            assert_same_bits(torch.tensor([0.0], dtype=dtype), torch.tensor([-0.0], dtype=dtype))
        assert_same_bits(
            torch.tensor([float("nan"), -0.0], dtype=dtype), torch.tensor([float("nan"), -0.0], dtype=dtype)
        )


def both(fn, *args, **kwargs):
    return fn(*args, impl="torch", **kwargs), fn(*args, impl="triton", **kwargs)


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,rows", SHAPES, ids=str)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_quantize_and_dequantize_bit_exact(shape, rows, group_size, dtype, bits, stochastic):
    x = data(shape, dtype, seed=group_size)
    ref, tri = both(quantize, x, bits, group_size, rows=rows, stochastic=stochastic, seed=1234)
    assert_same_q(ref, tri)
    assert_same_bits(*both(dequantize, tri, dtype=dtype))


@pytest.mark.parametrize(
    "n,dtype,bits,group_size,stochastic",
    [
        (2**20 + 3, torch.float32, 8, 512, False),
        (2**20 + 3, torch.bfloat16, 4, 128, False),
        # stochastic rounding costs ~10x in the interpreter (Philox in numpy): many tiles, fewer elements
        (2**16 + 3, torch.float16, 4, 128, True),
    ],
    ids=["2^20+3-fp32-int8-g512", "2^20+3-bf16-int4-g128", "2^16+3-fp16-int4-g128-stochastic"],
)
def test_large_odd_size_bit_exact(n, dtype, bits, group_size, stochastic):
    x = data((n,), dtype)
    ref, tri = both(quantize, x, bits, group_size, stochastic=stochastic, seed=7)
    assert_same_q(ref, tri)
    assert_same_bits(*both(dequantize, tri, dtype=dtype))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_blocks_bit_exact(bits, dtype):
    x = data((6 * 32 + 10,), dtype)
    x[32:64] = 0  # zero block
    x[70] = float("nan")
    x[100] = float("inf")
    x[140] = float("-inf")
    x[190:] = 0  # trailing partial block of zeros
    x[5] = 1e-30 if dtype == torch.float32 else x[5]  # tiny value beside normal ones
    ref, tri = both(quantize, x, bits, 32)
    assert_same_q(ref, tri)
    assert torch.isnan(tri.scales[0, 2:5]).all() and tri.scales[0, 1] == 0 and tri.scales[0, 6] == 0
    for out_dtype in DTYPES:
        y_ref, y_tri = both(dequantize, tri, dtype=out_dtype)
        assert_same_bits(y_ref, y_tri)
        assert torch.isnan(y_tri[0, 64:160]).all() and torch.isfinite(y_tri[0, :64]).all()


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # numpy, in the interpreter
def test_huge_values_and_output_overflow_bit_exact():
    """Near-FLT_MAX inputs stay finite in fp32; written to fp16 they overflow to inf like torch."""
    x = torch.tensor([3e38, -1e38, 1.0, 70000.0, -65520.0, 5.0])
    ref, tri = both(quantize, x, 8, 2)
    assert_same_q(ref, tri)
    for dtype in DTYPES:
        assert_same_bits(*both(dequantize, tri, dtype=dtype))


@pytest.mark.parametrize("bits", [8, 4])
def test_subnormal_blocks_bit_exact(bits):
    """Blocks whose values or scales are subnormal fp32 (GPU flush-to-zero would differ)."""
    x = torch.tensor(
        [
            1e-40,
            -3e-39,
            2e-45,
            0.0,  # subnormal values, subnormal scale
            5e-38,
            -1e-38,
            2e-38,
            3e-38,  # normal values, subnormal scale
            1.0,
            1e-40,
            -2.0,
            1e-45,
        ]
    )  # normal scale, subnormal values (code 0)
    ref, tri = both(quantize, x, bits, 4)
    assert_same_q(ref, tri)
    assert ref.scales[0, 0] > 0 and ref.scales[0, 1] < 1.18e-38  # really subnormal
    assert_same_bits(*both(dequantize, tri))


@pytest.mark.parametrize("out_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", [8, 4])
def test_dequantize_into_out_buffer(out_dtype, bits):
    q = quantize(data((3, 100), torch.float32), bits, 64, rows=3)
    out = torch.full((300,), 5.0, dtype=out_dtype)
    res = dequantize(q, out=out, impl="triton")
    assert res is out
    assert_same_bits(out, dequantize(q, dtype=out_dtype, impl="torch").view(-1))


def test_strided_input_and_empty_tensor():
    x = data((64, 33), torch.bfloat16).t()  # non-contiguous view
    assert_same_q(*both(quantize, x, 4, 16, rows=33))
    e_ref, e_tri = both(quantize, torch.empty(0), 8, 16)
    assert_same_q(e_ref, e_tri)
    assert dequantize(e_tri, impl="triton").shape == (1, 0)


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("in_bits,out_bits", [(8, 8), (4, 4), (8, 4), (4, 8)])
@pytest.mark.parametrize("k", [1, 3, 4])
def test_reductions_bit_exact(k, in_bits, out_bits, stochastic):
    rows, cols, gs = 3, 257, 64
    qs = [quantize(data((rows, cols), torch.float32, seed=i), in_bits, gs, rows=rows) for i in range(k)]
    s = stack(qs)
    ref, tri = both(dequantize_sum_requantize, s, out_bits, stochastic=stochastic, seed=99)
    assert_same_q(ref, tri)
    # the fused result is quantize(sum of dequantized), computed here with the Triton kernels alone
    unfused = quantize(
        dequantize_sum(s, impl="triton"), out_bits, gs, rows=rows, stochastic=stochastic, seed=99, impl="triton"
    )
    assert_same_q(tri, unfused)
    for dtype in DTYPES:
        assert_same_bits(*both(dequantize_sum, s, dtype=dtype))


def test_reductions_of_nothing_are_zero():
    empty = QuantizedTensor(torch.zeros(0, 2, 64, dtype=torch.int8), torch.zeros(0, 2, 1), 50, 8, 64)
    for impl in ("torch", "triton"):
        assert torch.equal(dequantize_sum(empty, impl=impl), torch.zeros(2, 50))
        r = dequantize_sum_requantize(empty, 4, impl=impl)
        assert torch.equal(r.scales, torch.zeros(2, 1))
        assert torch.equal(r.codes, torch.full((2, 32), 0x88, dtype=torch.uint8))


@pytest.mark.parametrize("bits", [8, 4])
def test_reductions_with_special_blocks_bit_exact(bits):
    a, b, c = (data((2, 200), torch.float32, seed=i) for i in range(3))
    a[0, 10] = float("nan")  # block 0 of row 0
    b[1, 150] = float("-inf")  # block 1 of row 1
    b[0, 100:200] = 0
    c[0, 100:200] = 0  # block 1 of row 0 is zero in b and c ...
    a[0, 100:200] = -0.0  # ... and negative zero in a
    s = stack([quantize(t, bits, 100, rows=2) for t in (a, b, c)])
    assert_same_q(*both(dequantize_sum_requantize, s, bits))
    r = dequantize_sum_requantize(s, bits, impl="triton")
    assert torch.isnan(r.scales[0, 0]) and torch.isnan(r.scales[1, 1]) and r.scales[0, 1] == 0
    out_ref, out_tri = torch.empty(400, dtype=torch.bfloat16), torch.empty(400, dtype=torch.bfloat16)
    dequantize_sum(s, out=out_ref, impl="torch")
    assert dequantize_sum(s, out=out_tri, impl="triton") is out_tri
    assert_same_bits(out_ref, out_tri)


# ---------------------------------------------------------------------------------------------
def test_reference_stream_matches_the_triton_stream_beyond_32_bit_counters():
    """Stochastic offsets are int64; tensors past 2**34 elements use Philox's second counter word
    (counter = offset // 4), which no interpreter-sized tensor reaches, so check the reference
    uniforms against the kernels' own (``_triton.stochastic_uniform``) there."""
    import triton
    import triton.language as tl

    @triton.jit
    def rand_kernel(out_ptr, seed, base, N: tl.constexpr):  # out_ptr: *fp32 [N]
        offs = base + tl.arange(0, N).to(tl.int64)
        tl.store(out_ptr + tl.arange(0, N), stochastic_uniform(seed, offs))

    for seed, base in [(0, 0), (2**40 + 5, 2**34 - 7), (123, 5 * 2**35 + 1)]:
        out = torch.empty(64)
        rand_kernel[(1,)](out, seed, base, N=64)
        assert torch.equal(out, philox_uniform(seed, torch.arange(64, dtype=torch.int64) + base))


# ---------------------------------------------------------------------------------------------
# Caller-provided outputs and the launch-plan caches.
# ---------------------------------------------------------------------------------------------
def quantized_views(buf: torch.Tensor, offset: int, rows: int, cols: int, bits: int, gs: int) -> QuantizedTensor:
    """A QuantizedTensor whose codes and then scales are views into the byte buffer ``buf`` from
    ``offset`` on, as a collective's send buffer holds them (one message, scales included)."""
    from zeropp.kernels import num_groups, row_bytes

    rb, g = row_bytes(cols, bits, gs), num_groups(cols, gs)
    codes = buf[offset : offset + rows * rb].view(torch.int8 if bits == 8 else torch.uint8).view(rows, rb)
    start = offset + rows * rb
    start += -start % 4  # fp32 scales start 4-byte aligned
    scales = buf[start : start + 4 * rows * g].view(torch.float32).view(rows, g)
    return QuantizedTensor(codes, scales, cols, bits, gs)


@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantize_into_views_of_a_send_buffer(dtype, bits, stochastic):
    """``out=`` is written in place (codes and scales views into one byte buffer, at an offset
    that is not 16-byte aligned) with the reference's bits; the rest of the buffer is untouched."""
    rows, cols, gs = 3, 257, 64
    x = data((rows, cols), dtype, seed=bits)
    buf = torch.full((8192,), 0xAB, dtype=torch.uint8)
    out = quantized_views(buf, 5, rows, cols, bits, gs)
    got = quantize(x, bits, gs, rows=rows, stochastic=stochastic, seed=77, impl="triton", out=out)
    assert got is out
    assert_same_q(out, quantize(x, bits, gs, rows=rows, stochastic=stochastic, seed=77, impl="torch"))
    used = torch.zeros_like(buf, dtype=torch.bool)
    used[5 : 5 + out.codes.numel()] = True
    s0 = out.scales.data_ptr() - buf.data_ptr()
    used[s0 : s0 + 4 * out.scales.numel()] = True
    assert (buf[~used] == 0xAB).all()
    # the CPU path (impl="torch") takes out= too, through a copy
    out2 = quantized_views(torch.zeros(8192, dtype=torch.uint8), 0, rows, cols, bits, gs)
    assert quantize(x, bits, gs, rows=rows, stochastic=stochastic, seed=77, impl="torch", out=out2) is out2
    assert_same_q(out2, out)


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("in_bits,out_bits", [(8, 4), (4, 8)])
def test_dequantize_sum_requantize_into_out(in_bits, out_bits, impl):
    rows, cols, gs = 2, 300, 100
    s = stack([quantize(data((rows, cols), torch.float32, seed=i), in_bits, gs, rows=rows) for i in range(3)])
    out = quantized_views(torch.zeros(4096, dtype=torch.uint8), 3, rows, cols, out_bits, gs)
    assert dequantize_sum_requantize(s, out_bits, stochastic=True, seed=5, impl=impl, out=out) is out
    assert_same_q(out, dequantize_sum_requantize(s, out_bits, stochastic=True, seed=5, impl="torch"))


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_wrong_out_is_a_clear_error(impl):
    x = data((2, 100), torch.float32)
    good = quantize(x, 8, 64, rows=2, impl=impl)
    wrong = [
        (quantize(x, 8, 64, rows=1, impl="torch"), ValueError, "does not fit"),  # [1, *] for [2, *]
        (quantize(x[:, :99], 8, 64, rows=2, impl="torch"), ValueError, "cols=99"),  # other cols
        (quantize(x, 4, 64, rows=2, impl="torch"), ValueError, "bits=4"),  # other bits
        (quantize(x, 8, 32, rows=2, impl="torch"), ValueError, "group_size=32"),  # other group size
        (stack([good]), ValueError, "does not fit"),  # stacked [1, 2, *]
        (QuantizedTensor(good.codes.t().contiguous().t(), good.scales, 100, 8, 64), ValueError, "contiguous"),
        (good.codes, TypeError, "QuantizedTensor"),
    ]
    for out, err, msg in wrong:
        with pytest.raises(err, match=msg):
            quantize(x, 8, 64, rows=2, impl=impl, out=out)
    s = stack([good, good])
    with pytest.raises(ValueError, match="does not fit"):
        dequantize_sum_requantize(s, 4, impl=impl, out=good)  # INT8 out for an INT4 result
    with pytest.raises(ValueError, match="expected rows\\*cols = 200"):
        dequantize(good, out=torch.empty(199), impl=impl)


def test_plans_cached_per_key_give_exact_results_in_any_order():
    """Interleaved shapes, dtypes, bits, group sizes, roundings and seeds share the plan caches
    (one plan per key, reused): every call still matches the reference."""
    from zeropp.kernels.quantize import dequantize_plan, quantize_plan

    quantize_plan.cache_clear()
    dequantize_plan.cache_clear()
    cases = [
        ((7,), 1, torch.float32, 8, 2, False, 0),
        ((17, 257), 17, torch.bfloat16, 4, 100, True, 3),
        ((7,), 1, torch.float16, 8, 2, False, 0),
        ((17, 257), 17, torch.bfloat16, 4, 100, True, 2**40 + 1),
        ((17, 257), 17, torch.bfloat16, 4, 100, False, 3),
        ((7,), 1, torch.float32, 4, 2, False, 1),
        ((7,), 1, torch.float32, 8, 2, False, 0),
        ((33,), 3, torch.float32, 8, 2, True, 1),
    ]
    for shape, rows, dtype, bits, gs, st, seed in cases * 2:
        x = data(shape, dtype, seed=seed % 97)
        ref, tri = both(quantize, x, bits, gs, rows=rows, stochastic=st, seed=seed)
        assert_same_q(ref, tri)
        for out_dtype in (dtype, torch.float32):
            assert_same_bits(*both(dequantize, tri, dtype=out_dtype))
    distinct = {(shape, rows, dtype, bits, gs, st) for shape, rows, dtype, bits, gs, st, _ in cases}
    assert quantize_plan.cache_info().currsize == len(distinct)
    assert quantize_plan.cache_info().hits >= len(cases)


def test_plans_refuse_bad_arguments_like_the_reference():
    x = data((10,), torch.float32)
    for kwargs, msg in [
        (dict(bits=3), "bits=3"),
        (dict(group_size=0), "group_size"),
        (dict(bits=4, group_size=3), "odd"),
        (dict(rows=3), "equal rows"),
        (dict(seed=-1), "seed"),
    ]:
        args = dict(bits=8, group_size=4, rows=1, seed=0) | kwargs
        for impl in ("torch", "triton"):
            with pytest.raises(ValueError, match=msg):
                quantize(x, args["bits"], args["group_size"], rows=args["rows"], seed=args["seed"], impl=impl)
    with pytest.raises(ValueError, match="int64"):
        quantize(torch.zeros(4, dtype=torch.int64), 8, 4, impl="triton")


# ---------------------------------------------------------------------------------------------
# The direct launch of LaunchPlan (CUDA only), with a fake kernel and fake CUDA tensors.
# ---------------------------------------------------------------------------------------------
class _FakeCompiled:
    function, packed_metadata = "fn", "meta"

    def __init__(self, log):
        self.log = log

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, gx, gy, gz, stream, function, packed, launch_meta, enter, exit_, *args):
        self.log.append(("direct", gx, stream, args))


class _FakeKernel:
    arg_names: ClassVar[list[str]] = ["a_ptr", "b_ptr", "n", "seed", "BLOCK_G", "X", "BLOCK_GS"]

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.log.append(("jit", grid[0], args, meta))
            return _FakeCompiled(self.log)

        return launch


class _FakeCudaTensor:
    is_cuda = True

    def __init__(self, ptr, dtype=torch.float32):
        self.ptr, self.device, self.dtype = ptr, torch.device("cuda", 0), dtype

    def data_ptr(self):
        return self.ptr


def test_launch_plan_binds_once_per_specialisation(monkeypatch):
    """First launch per (device, pointer alignments, per-call int traits) goes through
    ``kernel[grid]`` (Triton compiles and specialises); repeats call the compiled launcher with
    the same arguments in parameter order; a differently aligned pointer or a seed of another
    Triton specialisation (1, a multiple of 16, beyond 32 bits) is bound anew."""
    from zeropp.kernels import _triton

    monkeypatch.setattr(_triton, "DIRECT_LAUNCH", True)
    monkeypatch.setattr(_triton, "current_device", lambda: 0)
    monkeypatch.setattr(_triton, "current_stream", lambda dev: 1234)
    monkeypatch.setattr(_triton, "on_device", lambda t: __import__("contextlib").nullcontext())
    cfg = _triton.TileConfig(100, 70, 3)
    kern = _FakeKernel()
    plan = _triton.LaunchPlan(kern, cfg, (5,), dict(X=9))
    a, b, b_odd = _FakeCudaTensor(4096), _FakeCudaTensor(8192), _FakeCudaTensor(8194)
    calls = [
        ((a, b), 3),
        ((a, b), 5),
        ((a, b_odd), 5),
        ((a, b_odd), 7),
        ((a, b), 1),
        ((a, b), 32),
        ((a, b), 2**40),
        ((a, b), 2**40 + 16),
        ((a, b), 48),
    ]
    for tensors, seed in calls:
        plan(tensors, (seed,))
    # a plan may serve inputs of several dtypes (the Hadamard plan does): each gets its own binding
    a_bf16 = _FakeCudaTensor(4096, torch.bfloat16)
    for tensors, seed in (((a_bf16, b), 5), ((a_bf16, b), 5), ((a, b), 5)):
        plan(tensors, (seed,))
    kinds = [entry[0] for entry in kern.log]
    assert kinds == [
        "jit",
        "direct",
        "jit",
        "direct",
        "jit",
        "jit",
        "jit",
        "direct",
        "direct",
        "jit",
        "direct",
        "direct",
    ]
    consts = (cfg.block_g, 9, cfg.block_gs)  # in the kernel's parameter order
    assert kern.log[1] == ("direct", cfg.grid, 1234, (a, b, 5, 5, *consts))
    jit_meta = kern.log[0][3]
    assert jit_meta["BLOCK_G"] == cfg.block_g and jit_meta["X"] == 9 and jit_meta["enable_fp_fusion"] is False
    assert kern.log[0][1] == cfg.grid == 3 * cfg.tiles_per_row


@pytest.mark.parametrize(
    "group_size,groups,rows",
    [(2, 1, 1), (64, 5, 17), (128, 1 << 14, 4), (512, 1 << 18, 1), (4096, 3, 1), (1 << 14, 1, 1)],
)
def test_tile_config_size_classes(group_size, groups, rows):
    """Power-of-two tiles that hold whole blocks, never more blocks than a row has, and one grid
    program per tile of every row."""
    from zeropp.kernels._triton import TILE_ELEMS, TileConfig

    cfg = TileConfig(group_size, groups, rows)
    assert cfg.block_gs >= group_size and cfg.block_gs & (cfg.block_gs - 1) == 0
    assert cfg.block_g & (cfg.block_g - 1) == 0 and cfg.block_g <= max(1, 2 * groups)
    assert cfg.block_g * cfg.block_gs <= max(2 * TILE_ELEMS, cfg.block_gs)
    assert cfg.grid == rows * -(-groups // cfg.block_g)
