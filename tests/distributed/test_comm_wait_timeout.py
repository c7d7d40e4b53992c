"""``CommHandle.wait(timeout)`` bounds the wait as ``dist.Work.wait(timeout)`` does: a peer that
joins late makes the bounded wait raise once its time has passed, and a later ``wait()``
finishes the collective with the right result (the handle kept its buffers). Every public
collective's handle: the plain all-reduce, the quantized all-gather, the single-hop and the
hierarchical qgZ (whose second hop is a continuation on the comm worker)."""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from tests.worlds import run_world
from zeropp.comm import QuantSpec, Topology, all_reduce, quantized_all_gather, quantized_reduce_scatter

LATE_S = 3.0
"""How long rank 1 keeps its peers waiting before it joins each collective."""
BOUND = datetime.timedelta(seconds=0.5)


def _calls(topo: Topology, world: int) -> dict:
    n = 64
    return {
        "all_reduce": lambda: all_reduce(torch.ones(n), topology=topo, async_op=True),
        "quantized all-gather": lambda: quantized_all_gather(
            torch.empty(world * n), torch.ones(n), spec=QuantSpec(bits=8), topology=topo, async_op=True
        ),
        "qgZ": lambda: quantized_reduce_scatter(
            torch.empty(n), torch.ones(world * n), spec=QuantSpec(bits=4), topology=topo, async_op=True
        ),
    }


def _late_peer(rank: int, world: int) -> dict[str, object]:
    topo = Topology.from_world(world, ranks_per_node=2)  # 2 x 2: qgZ is hierarchical
    topo.build()
    out: dict[str, object] = {}
    for name, call in _calls(topo, world).items():
        dist.barrier()
        if rank == 1:
            time.sleep(LATE_S)
        handle = call()
        assert handle is not None
        t0 = time.monotonic()
        try:
            handle.wait(timeout=BOUND)
            out[f"{name}: bounded"] = "returned"
        except RuntimeError as e:
            out[f"{name}: bounded"] = f"raised after {time.monotonic() - t0:.1f} s: {e}"
        handle.wait()  # the peer comes: the collective finishes
        out[f"{name}: finished"] = handle.is_completed()
    return out


def test_a_bounded_wait_raises_in_time_and_a_later_wait_finishes() -> None:
    res = run_world(_late_peer, 4, timeout=120)
    for rank in (0, 2, 3):  # every rank but the late one
        r = res[rank]
        for name in ("all_reduce", "quantized all-gather", "qgZ"):
            bounded = r[f"{name}: bounded"]
            assert isinstance(bounded, str) and bounded.startswith("raised after"), (rank, name, bounded)
            assert float(bounded.split()[2]) < LATE_S - 1.0, (rank, name, bounded)  # not held until the peer came
            assert r[f"{name}: finished"] is True, (rank, name, r)
