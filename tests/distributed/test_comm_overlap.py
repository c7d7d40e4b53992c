"""Communication that runs without the caller: qgZ's cross-node hop issued before ``wait()``,
several reduce-scatters outstanding at once, and the DDP hook's real future.

References: the synchronous calls (whose results ``test_comm_collectives`` checks bit for bit
against the kernels), and their byte accounting, which the asynchronous calls must reproduce
exactly. The continuation machinery (``zeropp.comm.chain``) is checked on its own first: FIFO
order, errors re-raised in ``wait()``, inline nesting on the worker.

The 2x2 world runs in the streams debug mode (``ZEROPP_DEBUG_STREAMS=1``, set by the launcher):
its checks pass there too, and ``tests/streams_helpers.py`` adds the mode's own checks (results
unchanged by the mode; early releases turned into wrong results). The 3x2 world runs without.

Here: the gloo-world checks of this topic; its other tiers' checks are in ``tests/unit/test_comm_overlap.py``.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

import zeropp.comm.qgz as qgz_mod
from tests.comm_helpers import rank_input
from tests.streams_helpers import DEBUG_ENV, FakeBucket, debug_checks
from tests.worlds import run_world
from zeropp.comm import CommStats, ErrorFeedback, QuantSpec, Topology, chain, quantized_reduce_scatter
from zeropp.comm.collectives import quantized_all_reduce
from zeropp.comm.ddp import QuantizedAllReduceState, quantized_allreduce_hook

CPU = torch.device("cpu")


# ------------------------------------------------------------------ qgZ on gloo worlds
SPECS = [QuantSpec(bits=4), QuantSpec(bits=8, intra_bits=4, group_size=32)]


def _count_issued(groups: list) -> None:
    """Wrap qgZ's backend all-to-all to record the group of every issued collective."""
    real = qgz_mod.backend_all_to_all

    def counting(out, inp, group, async_op):
        groups.append(group)
        return real(out, inp, group, async_op)

    qgz_mod.backend_all_to_all = counting


def _outstanding(rank: int, world: int, nodes: int, rpn: int, debug: bool) -> dict:
    topo = Topology(nodes, rpn)
    cross = topo.build().cross
    issued: list = []
    _count_issued(issued)
    res = {}
    for si, spec in enumerate(SPECS):
        sizes = [1, 7, 257]  # awkward chunk sizes, several calls outstanding at once
        xs = [rank_input(60 + si, rank, world * n, torch.float32) for n in sizes]
        sync_stats, async_stats = CommStats(), CommStats()
        sync_out = [torch.empty(n) for n in sizes]
        for o, x in zip(sync_out, xs):
            quantized_reduce_scatter(o, x, spec=spec, topology=topo, stats=sync_stats)
        issued.clear()
        outs = [torch.empty(n) for n in sizes]
        handles = [
            quantized_reduce_scatter(o, x, spec=spec, topology=topo, stats=async_stats, async_op=True)
            for o, x in zip(outs, xs)
        ]
        # every hop 2 goes out without any wait(): hop 1 lands, the worker issues hop 2
        deadline = time.monotonic() + 60
        while sum(g is cross for g in issued) < len(sizes) and time.monotonic() < deadline:
            time.sleep(0.01)
        res[f"hop2_before_wait_{si}"] = sum(g is cross for g in issued)
        assert not any(h.is_completed() for h in handles)  # no wait() was called yet
        for h in reversed(handles):  # any wait order
            h.wait()
        for o, s in zip(outs, sync_out):
            assert torch.equal(o, s), "an outstanding async reduce-scatter differs from the synchronous one"
        assert async_stats.snapshot() == sync_stats.snapshot(), "byte accounting changed"
        assert async_stats.calls() == sync_stats.calls()
    # error feedback with two buckets outstanding: the same residuals as the synchronous calls
    ef_s, ef_a, spec = ErrorFeedback(), ErrorFeedback(), QuantSpec(bits=4, error_feedback=True)
    n = 9
    for step in range(2):
        xs = [rank_input(70 + step * 2 + b, rank, world * n, torch.float32) for b in range(2)]
        so = [torch.empty(n) for _ in xs]
        for b, (o, x) in enumerate(zip(so, xs)):
            quantized_reduce_scatter(o, x, spec=spec, topology=topo, error_feedback=ef_s, feedback_key=f"b{b}")
        ao = [torch.empty(n) for _ in xs]
        hs = [
            quantized_reduce_scatter(
                o, x, spec=spec, topology=topo, error_feedback=ef_a, feedback_key=f"b{b}", async_op=True
            )
            for b, (o, x) in enumerate(zip(ao, xs))
        ]
        for h in hs:
            h.wait()
        assert all(torch.equal(a, s) for a, s in zip(ao, so))
        for b in range(2):
            assert torch.equal(ef_a.residual(f"b{b}", world * n, CPU), ef_s.residual(f"b{b}", world * n, CPU))
    res["ddp_future_pending"] = _ddp_future(rank, world, nodes, rpn)  # same launch: a launch costs seconds
    if debug:
        res["streams"] = debug_checks(rank, world)
    return res


@pytest.fixture(scope="module", params=[(2, 2), (3, 2)], ids=["2x2", "3x2"])
def world(request) -> tuple[tuple[int, int], list[dict]]:
    """The 2x2 world runs in the streams debug mode (``tests/streams_helpers.py``), the 3x2 one without."""
    nodes, rpn = request.param
    debug = request.param == (2, 2)
    return request.param, run_world(
        _outstanding, nodes * rpn, nodes, rpn, debug, timeout=240, env=DEBUG_ENV if debug else None
    )


def test_outstanding_reduce_scatters_issue_hop2_before_wait(world) -> None:
    _, res = world
    for r in res:
        assert r["hop2_before_wait_0"] == 3 and r["hop2_before_wait_1"] == 3


# ------------------------------------------------------------------ DDP hook
def _ddp_future(rank: int, world: int, nodes: int, rpn: int) -> bool:
    topo = Topology(nodes, rpn)
    state = QuantizedAllReduceState(grads=QuantSpec(bits=4), topology=topo, stats=CommStats())
    sizes = [5, 33]
    grads = [rank_input(80 + k, rank, n, torch.float32) for k, n in enumerate(sizes)]
    expect = [
        quantized_all_reduce(g.clone(), dist.ReduceOp.AVG, spec=QuantSpec(bits=4), topology=topo, stats=CommStats())
        for g in grads
    ]
    gate = threading.Event()
    blocker = chain.submit(lambda: gate.wait(30), CPU)  # holds the comm worker
    bufs = [g.clone() for g in grads]
    futs = [quantized_allreduce_hook(state, FakeBucket(b, k)) for k, b in enumerate(bufs)]
    pending = not any(f.done() for f in futs)  # the hook returned before its collectives ran
    gate.set()
    blocker.wait()
    for f, b, e in zip(futs, bufs, expect):
        assert f.wait() is b and torch.equal(b, e), "the hook's result differs from quantized_all_reduce"
    return pending


def test_ddp_hook_returns_a_pending_future(world) -> None:
    _, res = world
    assert all(r["ddp_future_pending"] for r in res)


# ------------------------------------------------------------------ the streams debug mode (2x2 world)
def _debug(world) -> list[dict]:
    shape, res = world
    if "streams" not in res[0]:
        pytest.skip(f"the streams debug mode runs in the 2x2 world only, this one is {shape[0]}x{shape[1]}")
    return [r["streams"] for r in res]


def test_debug_mode_reaches_the_ranks_and_changes_no_result(world) -> None:
    for r in _debug(world):
        assert r["debug_on"]
        assert all(r["fixed"].values()), r["fixed"]


def test_debug_mode_turns_an_early_release_into_a_wrong_result(world) -> None:
    for r in _debug(world):
        assert not any(r["hop1_early"].values()), r["hop1_early"]  # every case runs hierarchical qgZ
        assert r["pool_early"] == {"engine": False}, r["pool_early"]
