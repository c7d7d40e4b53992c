"""The local sum of gloo's all-to-all reduce-scatter (``collectives.rank_order_sum``): rows added in
rank order, one rounded addition at a time in fp32 / fp64, and accumulated in fp32 in half precision."""

from __future__ import annotations

import pytest
import torch

from zeropp.comm.collectives import rank_order_sum


def _rows(W: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(97 * W + n)
    mag = torch.logspace(-6, 6, W * n, dtype=torch.float64)[torch.randperm(W * n, generator=g)]
    return (torch.randn(W * n, generator=g, dtype=torch.float64) * mag).to(dtype).view(W, n)  # [W, n]


@pytest.mark.parametrize("W", [1, 2, 3, 4, 5, 8, 16])
@pytest.mark.parametrize("n", [1, 7, 17 * 257])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_full_precision_adds_in_rank_order(W: int, n: int, dtype: torch.dtype) -> None:
    rows = _rows(W, n, dtype)
    want = rows[0].clone()  # [n]
    for j in range(1, W):
        want = want + rows[j]  # rounded after each addition, rank 0 first
    out = torch.empty(n, dtype=dtype)
    assert rank_order_sum(rows, out) is out
    assert torch.equal(out, want)


def test_rank_order_differs_from_a_pairwise_order() -> None:
    """Not vacuous: from 5 rows on, an order other than rank order gives other bits on these rows."""
    rows = _rows(8, 17 * 257, torch.float32)
    out = torch.empty(rows.shape[1])
    rank_order_sum(rows, out)
    pairwise = ((rows[0] + rows[1]) + (rows[2] + rows[3])) + ((rows[4] + rows[5]) + (rows[6] + rows[7]))
    assert not torch.equal(out, pairwise)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("W", [1, 2, 4, 5, 16])
def test_half_precision_is_rounded_once(W: int, dtype: torch.dtype) -> None:
    rows = _rows(W, 17 * 257, dtype).clamp(-1000, 1000)  # [W, n], inside fp16's range
    out = torch.empty(rows.shape[1], dtype=dtype)
    rank_order_sum(rows, out)
    want = rows.float()[0].clone()
    for j in range(1, W):
        want += rows.float()[j]  # fp32 accumulation in rank order, one rounding at the end
    assert torch.equal(out, want.to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_columns_cut_anywhere_give_the_same_bits(dtype: torch.dtype) -> None:
    """A reduction cut into column chunks (the backend's buckets, the shared-memory transport's
    rows) sums each column the same way: the result does not depend on the cut."""
    rows = _rows(16, 64, dtype).clamp(-1000, 1000)  # [16, 64]
    whole = rank_order_sum(rows, torch.empty(64, dtype=dtype))
    cut = torch.empty(64, dtype=dtype)
    for a, b in ((0, 57), (57, 64)):
        rank_order_sum(rows[:, a:b], cut[a:b])
    assert torch.equal(cut, whole)
