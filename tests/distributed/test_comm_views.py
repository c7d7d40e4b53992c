"""The public collectives on views a user passes: a slice with a stride, a column block of a
matrix, a transpose. Each reduces or gathers exactly the view's elements and leaves the rest of
the buffer it lives in untouched, synchronous or asynchronous (gloo reduces a tensor's storage
from its offset, so a view handed to it as is would reduce the wrong elements)."""

from __future__ import annotations

import torch

from tests.worlds import run_world
from zeropp.comm import ReduceOp, all_reduce


def _base(rank: int) -> torch.Tensor:
    """A [4, 6] buffer, different on each rank: rank r's element i is (r + 1) * (i + 1)."""
    return (torch.arange(24, dtype=torch.float32) + 1).mul_(rank + 1).view(4, 6)


def _views(rank: int, world: int) -> dict[str, bool]:
    total = sum(r + 1 for r in range(world))  # the sum of every rank's base, element by element: total * (i + 1)
    out: dict[str, bool] = {}
    picks = {
        "every other element": lambda b: b.view(-1)[::2],
        "a column block": lambda b: b[:, 1:4],
        "a transpose": lambda b: b.t(),
        "one column": lambda b: b[:, 5],
    }
    for name, pick in picks.items():
        for async_op in (False, True):
            base = _base(rank)
            inside = torch.zeros(4, 6, dtype=torch.bool)
            pick(inside).fill_(True)
            h = all_reduce(pick(base), ReduceOp.SUM, async_op=async_op)
            if h is not None:
                h.wait()
            want = torch.where(inside, _base(0) * total, _base(rank))
            out[f"{name}, async={async_op}"] = torch.equal(base, want)
    return out


def test_all_reduce_of_a_view_reduces_the_view_and_nothing_else() -> None:
    for res in run_world(_views, 2):
        assert all(res.values()), {k: v for k, v in res.items() if not v}
