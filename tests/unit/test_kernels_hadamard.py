"""The blockwise Walsh-Hadamard rotation: the Triton kernel (under TRITON_INTERPRET=1) against the
torch reference bit for bit, the reference against the textbook matrix, the round trip, and the
reason for it all: on outlier-heavy data, rotate-quantize-dequantize-rotate-back loses less than
plain quantization.

Padding rule under test: a row of ``cols`` elements is zero padded to ``rotated_cols(cols, block)``
(whole blocks) before the transform; the forward result keeps all of them, the inverse keeps
``out_cols=cols``.

Here: the one-process checks of this topic; its other tiers' checks are in
``tests/e2e/test_kernels_hadamard.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.kernel_helpers import DTYPES, SHAPES, assert_same_bits, data
from tests.triton_helpers import interpreted
from zeropp.kernels import MAX_HADAMARD_BLOCK, dequantize, hadamard, quantize, rotated_cols
from zeropp.kernels._triton import HAS_TRITON
from zeropp.kernels.hadamard import hadamard_plan
from zeropp.kernels.reference import hadamard_ref, hadamard_scale

pytestmark = [pytest.mark.usefixtures("one_torch_thread")]
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

# 2: the smallest block, many blocks per tile; 8 and 128: typical; 512: larger than most rows
BLOCKS = [2, 8, 128, 512]


def sylvester(block: int) -> torch.Tensor:
    """The Sylvester Hadamard matrix H (entries +-1), fp64, by Kronecker products."""
    h = torch.ones(1, 1, dtype=torch.float64)
    base = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.kron(base, h)
    return h


@needs_triton
@interpreted
@pytest.mark.parametrize("shape, rows", SHAPES)
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_matches_reference_bit_for_bit(shape, rows, block, dtype) -> None:
    x = data(shape, dtype, seed=block)
    cols = x.numel() // rows
    for out_dtype in {torch.float32, dtype}:
        want = hadamard_ref(x, block, rows=rows, dtype=out_dtype)
        got = hadamard(x, block, rows=rows, dtype=out_dtype, impl="triton")
        assert got.shape == (rows, rotated_cols(cols, block))
        assert_same_bits(got, want)
    # the inverse: rotated fp32 rows back to the original length, into the input's dtype
    rot = hadamard_ref(x, block, rows=rows)
    assert_same_bits(
        hadamard(rot, block, rows=rows, out_cols=cols, dtype=dtype, impl="triton"),
        hadamard_ref(rot, block, rows=rows, out_cols=cols, dtype=dtype),
    )


@needs_triton
@interpreted
def test_triton_reads_views_and_writes_row_strided_out_bit_for_bit() -> None:
    """The codec hands the kernel qgZ's swizzled view ([rpn, nodes, n] of a [nodes, rpn, n]
    tensor) and row-strided outputs (columns of a gathered buffer); both are read / written in place."""
    x = data((2, 3, 37), torch.bfloat16, seed=5)  # nodes=2, rpn=3, n=37
    view = x.transpose(0, 1)  # [3, 2, 37], not contiguous
    assert_same_bits(hadamard(view, 8, rows=6, impl="triton"), hadamard_ref(view.contiguous(), 8, rows=6))
    big = torch.full((6, 50), 7.0)
    dst = big[:, 5:42]  # [6, 37] row-strided
    got = hadamard(hadamard_ref(view.contiguous(), 8, rows=6), 8, rows=6, out_cols=37, out=dst, impl="triton")
    assert got is dst
    assert torch.equal(big[:, :5], torch.full((6, 5), 7.0)) and torch.equal(big[:, 42:], torch.full((6, 8), 7.0))
    want = torch.full((6, 50), 7.0)
    hadamard_ref(hadamard_ref(view.contiguous(), 8, rows=6), 8, rows=6, out_cols=37, out=want[:, 5:42])
    assert_same_bits(big, want)


@needs_triton
@interpreted
def test_non_finite_blocks_spread_nan_inside_their_block_only() -> None:
    x = data((64,), torch.float32, seed=3)
    x[3], x[20], x[40] = float("nan"), float("inf"), float("-inf")
    want = hadamard_ref(x, 16)
    assert_same_bits(hadamard(x, 16, impl="triton"), want)
    v = want.view(4, 16)
    assert torch.isnan(v[0]).all() and not torch.isfinite(v[1]).any() and not torch.isfinite(v[2]).any()
    assert torch.isfinite(v[3]).all()  # other blocks untouched


@pytest.mark.parametrize("block", [2, 4, 8, 32, 128])
def test_reference_is_the_normalised_sylvester_matrix(block) -> None:
    x = data((3, 2 * block + 1), torch.float32, seed=block)
    cols = x.shape[1]
    pad = torch.zeros(3, rotated_cols(cols, block), dtype=torch.float64)
    pad[:, :cols] = x.double()
    want = (pad.view(3, -1, block) @ sylvester(block).T / math.sqrt(block)).view(3, -1)
    got = hadamard_ref(x, block, rows=3)
    assert torch.allclose(got.double(), want, rtol=0, atol=1e-5 * float(x.abs().max()))
    assert hadamard_scale(block) == float(torch.tensor(block**-0.5, dtype=torch.float32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, rows", SHAPES)
def test_round_trip_and_norm(dtype, shape, rows) -> None:
    """H / sqrt(B) is orthogonal and its own inverse: rotating twice gives the input back (to fp32
    rounding, then the dtype's), and each padded row keeps its norm."""
    x = data(shape, dtype, seed=11)
    cols = x.numel() // rows
    for block in (2, 16, 256):
        rot = hadamard(x, block, rows=rows)  # [rows, padded] fp32
        back = hadamard(rot, block, rows=rows, out_cols=cols, dtype=dtype)
        assert back.dtype == dtype and back.shape == (rows, cols)
        ref = x.reshape(rows, cols).float()
        tol = 1e-6 * math.log2(block) * float(ref.abs().max()) + 1e-30
        assert torch.allclose(back.float(), ref, rtol=torch.finfo(dtype).eps, atol=tol)
        assert torch.allclose(rot.double().norm(dim=1), ref.double().norm(dim=1), rtol=1e-5)


def _outlier_data(kind: str, n: int, seed: int) -> torch.Tensor:
    """Heavy-tailed, gradient-like rows: ``channels`` = unit normals with 4 of every 128 positions
    20x larger (outlier features, the case rotations are made for), ``t3`` = Student-t with 3
    degrees of freedom (heavy tails everywhere)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "channels":
        return torch.randn(n, generator=g) * torch.where(torch.arange(n) % 128 < 4, 20.0, 1.0)
    z = torch.randn(n, generator=g)
    chi2 = sum(torch.randn(n, generator=g) ** 2 for _ in range(3))
    return z / torch.sqrt(chi2 / 3)


def _round_trip_errors(x: torch.Tensor, bits: int, gs: int) -> tuple[float, float]:
    """Relative L2 error of plain quantization and of rotate-quantize-dequantize-rotate-back."""
    plain = dequantize(quantize(x, bits, gs)).view(-1)
    rot = hadamard(x, gs)  # [1, padded]
    back = hadamard(dequantize(quantize(rot, bits, gs)), gs, out_cols=x.numel()).view(-1)
    return float((plain - x).norm() / x.norm()), float((back - x).norm() / x.norm())


@pytest.mark.parametrize("kind", ["channels", "t3"])
@pytest.mark.parametrize("bits, gs", [(4, 128), (8, 128), (4, 512)])
def test_rotation_lowers_quantization_error_on_outliers(kind, bits, gs) -> None:
    """The point of the rotation (SDP4Bit): outliers no longer set scales that flatten the rest of
    their block. On heavy-tailed data the rotated round trip's error is well below plain's
    (measured: 0.35-0.55x); on Gaussian data, where there is nothing to spread, it is about the same."""
    for seed in range(3):
        x = _outlier_data(kind, 16 * gs + 37, seed)
        e_plain, e_rot = _round_trip_errors(x, bits, gs)
        assert e_rot < 0.7 * e_plain, (kind, bits, gs, seed, e_rot, e_plain)
    g = torch.Generator().manual_seed(9)
    e_plain, e_rot = _round_trip_errors(torch.randn(16 * gs + 37, generator=g), bits, gs)
    assert e_rot < 1.1 * e_plain, ("gaussian", bits, gs, e_rot, e_plain)


def test_argument_errors_name_the_setting() -> None:
    x = torch.randn(10)
    for bad in (0, 1, 3, 12, MAX_HADAMARD_BLOCK * 2, True, 2.0):
        with pytest.raises(ValueError, match=r"Hadamard block=.* must be a power of two"):
            hadamard(x, bad)
    with pytest.raises(ValueError, match=r"out_cols=17 must be an int in \[0, 16\]"):
        hadamard(x, 8, out_cols=17)
    with pytest.raises(ValueError, match="cannot split 10 elements into 3 equal rows"):
        hadamard(x, 8, rows=3)
    with pytest.raises(ValueError, match="input dtype torch.int64 is not supported"):
        hadamard(torch.arange(8), 8)
    with pytest.raises(ValueError, match="impl must be"):
        hadamard(x, 8, impl="cuda")


def test_empty_rows() -> None:
    assert hadamard(torch.empty(0), 8).shape == (1, 0)
    assert hadamard(torch.empty(0), 8, rows=3).shape == (3, 0)


@needs_triton
@interpreted
def test_launch_plans_are_cached_per_shape() -> None:
    """Host path: the tile, grid and checks of a launch are worked out once per shape."""
    x = data((3, 40), torch.float32)
    hadamard(x, 8, rows=3, impl="triton")
    before = hadamard_plan.cache_info()
    hadamard(x, 8, rows=3, impl="triton")
    after = hadamard_plan.cache_info()
    assert after.hits == before.hits + 1 and after.misses == before.misses


def test_spec_accepts_the_kernels_largest_block_and_refuses_the_next() -> None:
    from zeropp.comm.spec import QuantSpec

    spec = QuantSpec(bits=8, group_size=MAX_HADAMARD_BLOCK, rotation="hadamard", hadamard_block=MAX_HADAMARD_BLOCK)
    assert spec.hadamard_block == MAX_HADAMARD_BLOCK
    with pytest.raises(ValueError, match=f"must be a power of two in \\[2, {MAX_HADAMARD_BLOCK}\\]"):
        QuantSpec(bits=8, rotation="hadamard", hadamard_block=2 * MAX_HADAMARD_BLOCK)
