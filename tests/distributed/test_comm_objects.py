"""JSON records between ranks (``zeropp/comm/objects.py``): the reference is each rank's own
object, as ``json`` reads it back; and every tensor the exchange hands to the backend goes through
the comm context, so no gloo thread frees one of its Python objects (the runner's last collective
before a rank exits; a free there during interpreter exit aborts the process).

Here: the gloo-world checks of this topic; its other tiers' checks are in ``tests/unit/test_comm_objects.py``.
"""

from __future__ import annotations

import math
import threading
import time
import weakref

import torch.distributed as dist

from tests.worlds import run_world
from zeropp.comm import context
from zeropp.comm.objects import all_gather_json


def _record(rank: int) -> object:
    """Records of different lengths per rank, rank 1's the longest; one with no payload at all."""
    if rank == 0:
        return {"rank": 0, "memory": {"params": 7, "grads": 0}, "loss": [1.5, math.inf]}
    if rank == 1:
        return {"rank": 1, "text": "é" * 300, "steps": list(range(257))}
    return None


def _gather(rank: int, world: int, iters: int) -> dict:
    main = threading.get_native_id()
    freed: list[int] = []
    ctx = context.current()
    issue = ctx.issue

    def tracked(call, tensors):
        for t in tensors:
            weakref.finalize(t, lambda: freed.append(threading.get_native_id()))
        return issue(call, tensors)

    ctx.issue = tracked  # instance attribute: backend.py calls context.current().issue
    try:
        out = [all_gather_json(_record(rank)) for _ in range(iters)]
        sub = dist.new_group([0, 2])
        pair = all_gather_json({"r": rank}, group=sub) if rank in (0, 2) else None
    finally:
        del ctx.issue
    assert ctx.close(timeout=30)
    deadline = time.monotonic() + 10
    while len(freed) < 4 * iters and time.monotonic() < deadline:
        time.sleep(0.01)
    return {
        "first": out[0],
        "same": all(o == out[0] for o in out),
        "pair": pair,
        "freed": len(freed),
        "off_main": sum(t != main for t in freed),
    }


def test_every_rank_gets_every_record_and_no_backend_thread_frees_them() -> None:
    results = run_world(_gather, 3, 30)
    expected = [_record(r) for r in range(3)]
    for r, res in enumerate(results):
        assert res["first"] == expected and res["same"], res["first"]
        assert res["pair"] == ([{"r": 0}, {"r": 2}] if r != 1 else None)
        # size, sizes, padded bytes, gathered bytes: four tensors a call, all freed on the main thread
        assert res["freed"] >= 4 * 30 and res["off_main"] == 0, res


def _not_json(rank: int, world: int) -> str:
    try:
        all_gather_json({"t": object()})
    except TypeError as e:
        return str(e)
    return "no error"


def test_a_record_that_is_not_json_is_refused_before_any_exchange() -> None:
    for msg in run_world(_not_json, 2):
        assert "not JSON serializable" in msg
