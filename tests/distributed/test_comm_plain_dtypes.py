"""A plain (``spec=None``) all-gather or reduce-scatter converts the received values into the
output's dtype between floating dtypes only. An integer or bool output for a float input (or
the reverse) would truncate or wrap every value silently (1.7 -> 1, -2.6 -> 254 in uint8), where
``torch.distributed`` refuses the pair: it is refused on every rank, before any message, and the
world stays in step.

A plain half-precision average is summed in fp32 and divided before its one rounding, so a mean
that the dtype holds comes back (gloo's own AVG sums in the half dtype first: two ranks of 40000
in fp16 gave inf, where DDP's all-reduce, which divides first, gives 40000)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.worlds import run_world
from zeropp.comm import ReduceOp, Topology, quantized_all_gather, quantized_all_reduce, quantized_reduce_scatter


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


def _half_means(rank: int, world: int) -> dict[str, list[float]]:
    topo = Topology.single_node(world)
    out: dict[str, list[float]] = {}
    for dt, big in ((torch.float16, 40000.0),):
        x = torch.full((world * 4,), big, dtype=dt)
        mine = torch.empty(4, dtype=dt)
        quantized_reduce_scatter(mine, x, ReduceOp.AVG, topology=topo)
        out[f"reduce-scatter {dt}"] = mine.float().tolist()
        y = torch.full((5,), big, dtype=dt)  # 5: padded to whole chunks
        quantized_all_reduce(y, ReduceOp.AVG, topology=topo)
        out[f"all-reduce {dt}"] = y.float().tolist()
    return out


def test_a_plain_half_precision_average_does_not_overflow_where_the_mean_fits() -> None:
    for r in run_world(_half_means, 2):
        for dt, big in (("torch.float16", 40000.0),):
            assert r[f"reduce-scatter {dt}"] == [big] * 4, r
            assert r[f"all-reduce {dt}"] == [big] * 5, r
