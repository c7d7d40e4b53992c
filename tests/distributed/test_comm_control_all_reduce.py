"""``zeropp.comm.backend.control_all_reduce``: the engine's small control exchanges (loss, squared
norms, forward-check flags) as one all-to-all round on gloo, reduced on every rank in rank order.

Checked against the formula: the sum is the rank-order sequence of fp64 additions of every rank's
values (not merely close: the same bits, on every rank), the max the element-wise max; the
asynchronous form writes nothing until it is finished; a view that cannot be reduced in place is
refused; a group that is a subset of the world reduces over its members only.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.worlds import run_world
from zeropp.comm.backend import control_all_reduce


def _values(rank: int, n: int) -> torch.Tensor:
    """fp64 values whose sum depends on the order of the additions (large and tiny magnitudes)."""
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(n, generator=g, dtype=torch.float64) * torch.tensor([1e16, 1.0, 3e-8, 7.0, -1e16])[:n]


def _world(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    t = _values(rank, 5)
    control_all_reduce(t, "sum")
    ref = _values(0, 5)
    for r in range(1, world):
        ref = ref + _values(r, 5)  # rank order, one addition at a time
    out["sum"] = (torch.equal(t, ref), t.tolist())

    flags = torch.tensor([rank, -rank, int(rank == 1), 0], dtype=torch.int64)
    control_all_reduce(flags, "max")
    out["max"] = flags.tolist()

    one = torch.full((1,), float(rank + 1), dtype=torch.float64)  # a single value
    finish = control_all_reduce(one, "sum", async_op=True)
    finish()
    out["one"] = one.item()

    vec = torch.arange(6, dtype=torch.float64) + rank
    control_all_reduce(vec[:3], "sum")  # a contiguous slice is reduced in place, the rest untouched
    out["slice"] = vec.tolist()

    with pytest.raises(RuntimeError):
        control_all_reduce(torch.zeros(4, 2, dtype=torch.float64).t(), "sum")  # not a flat view

    # a subgroup: ranks 0 and 2 only (every rank creates it; the others do not call the exchange)
    sub = dist.new_group([0, 2])
    if rank in (0, 2):
        x = torch.tensor([float(rank)], dtype=torch.float64)
        control_all_reduce(x, "sum", sub)
        out["sub"] = x.item()
    dist.barrier()
    return out


@pytest.mark.parametrize("world", [3, 4])
def test_control_all_reduce_matches_the_rank_order_formula(world: int) -> None:
    res = run_world(_world, world)
    base = world * (world - 1) / 2  # the sum of the ranks
    for rank, r in enumerate(res):
        assert r["sum"][0], r["sum"]
        assert r["sum"][1] == res[0]["sum"][1]  # the same bits on every rank
        assert r["max"] == [world - 1, 0, 1, 0]
        assert r["one"] == world * (world + 1) / 2
        assert r["slice"] == [world * k + base for k in range(3)] + [3.0 + rank, 4.0 + rank, 5.0 + rank]
    assert res[0]["sub"] == res[2]["sub"] == 2.0
    assert "sub" not in res[1]
