"""A plain (``spec=None``) all-gather or reduce-scatter converts the received values into the
output's dtype between floating dtypes only. An integer or bool output for a float input (or
the reverse) would truncate or wrap every value silently (1.7 -> 1, -2.6 -> 254 in uint8), where
``torch.distributed`` refuses the pair: it is refused on every rank, before any message, and the
world stays in step."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.worlds import run_world
from zeropp.comm import ReduceOp, Topology, quantized_all_gather, quantized_reduce_scatter


def _world(rank: int, world: int) -> dict[str, object]:
    topo = Topology.single_node(world)
    x = torch.tensor([1.7, -2.6, 300.5]) * (rank + 1)  # [3]
    every = torch.cat([torch.tensor([1.7, -2.6, 300.5]) * (r + 1) for r in range(world)])
    out: dict[str, object] = {}
    for dt in (torch.int32, torch.uint8, torch.bool):
        for name, call in {
            "all-gather": lambda dt=dt: quantized_all_gather(torch.empty(world * 3, dtype=dt), x, topology=topo),
            "reduce-scatter": lambda dt=dt: quantized_reduce_scatter(
                torch.empty(3, dtype=dt), x.repeat(world), ReduceOp.SUM, topology=topo
            ),
        }.items():
            try:
                call()
                out[f"{name} to {dt}"] = None
            except ValueError as e:
                out[f"{name} to {dt}"] = str(e)
    ints = torch.arange(3, dtype=torch.int64) + rank
    gathered = torch.empty(world * 3, dtype=torch.int64)
    quantized_all_gather(gathered, ints, topology=topo)  # one integer dtype: no conversion, allowed
    out["ints"] = gathered.tolist()
    half = torch.empty(world * 3, dtype=torch.float16)
    quantized_all_gather(half, x, topology=topo)  # float to float: converted
    out["half"] = torch.equal(half, every.to(torch.float16))
    t = torch.ones(1)
    dist.all_reduce(t)  # still in step
    out["after"] = t.item()
    return out


def test_a_plain_collective_refuses_to_cast_floats_to_integers_or_bools() -> None:
    res = run_world(_world, 2)
    for r in res:
        for dt in ("torch.int32", "torch.uint8", "torch.bool"):
            for name in ("all-gather", "reduce-scatter"):
                msg = r[f"{name} to {dt}"]
                assert isinstance(msg, str), (name, dt, msg)
                assert f"{name} output has dtype {dt} but its input torch.float32" in msg, msg
                assert "allocate the output as torch.float32" in msg, msg
        assert r["ints"] == [0, 1, 2, 1, 2, 3] and r["half"] is True and r["after"] == 2.0, r
    assert res[0] == res[1]
