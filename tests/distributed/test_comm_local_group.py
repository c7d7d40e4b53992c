"""Collectives over a group of one rank (world 1, hpZ groups of one, the cross group of a one-node
topology) are local copies made at issue: the same values as the backend's collective, a finished
work when asynchronous, and no call into ``torch.distributed`` at all. A reduction that is not the
identity on one value (``PRODUCT`` here, ``PREMUL_SUM`` on NCCL) still goes to the backend; groups
of two still communicate.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tests.worlds import run_world
from zeropp.comm import backend

_COLLECTIVES = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor")
_COLLECTIVES += ("all_to_all_single", "all_reduce")


def _world(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    solo = [dist.new_group([r]) for r in range(world)][rank]  # every rank creates every group
    x = torch.arange(7, dtype=torch.float32) * (rank + 1) + 0.25  # [7], an awkward size

    calls: list[str] = []
    saved = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def spy(name: str):
        def call(*args: Any, **kw: Any) -> Any:
            calls.append(name)
            return saved[name](*args, **kw)

        return call

    for name in saved:
        setattr(dist, name, spy(name))
    try:
        g = torch.full((7,), float("nan"))
        w = backend.backend_all_gather(g, x, solo, True)
        out["gather"] = (torch.equal(g, x), w.is_completed(), w.wait())
        rs = torch.full((7,), float("nan"))
        out["reduce_scatter"] = backend.backend_reduce_scatter(rs, x, dist.ReduceOp.AVG, solo, False) is None
        out["reduce_scatter_equal"] = torch.equal(rs, x)
        a2a = torch.full((7,), float("nan"))
        backend.backend_all_to_all(a2a, x, solo, False)
        out["all_to_all"] = torch.equal(a2a, x)
        y = x.clone()
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
            backend.backend_all_reduce(y, op, solo, False)
        out["all_reduce"] = torch.equal(y, x)
        out["calls_alone"] = list(calls)
        backend.backend_all_reduce(y, dist.ReduceOp.PRODUCT, solo, False)  # not an identity: the backend's
        out["product"] = (torch.equal(y, x), list(calls))
        calls.clear()
        both = torch.empty(7 * world)
        backend.backend_all_gather(both, x, None, False)  # the world: communicates
        out["world"] = (
            torch.equal(both, torch.cat([torch.arange(7, dtype=torch.float32) * (r + 1) + 0.25 for r in range(world)])),
            list(calls),
        )
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
    dist.barrier()
    return out


def test_a_group_of_one_copies_locally_and_calls_no_backend() -> None:
    for r in run_world(_world, 2):
        assert r["gather"] == (True, True, True)
        assert r["reduce_scatter"] and r["reduce_scatter_equal"] and r["all_to_all"] and r["all_reduce"]
        assert r["calls_alone"] == []
        assert r["product"] == (True, ["all_reduce"])
        assert r["world"][0] and len(r["world"][1]) == 1
