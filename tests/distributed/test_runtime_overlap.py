"""Overlap in the engine: the stream/event ordering of ``CommStreams`` and the schedule of
prefetched gathers and early reduce-scatters.

The CUDA ordering is checked on CPU with a recording fake of the stream API: the engine runs
on gloo ranks with the fake injected, must give bit-identical results to the engine without
streams (the reference), and its log must show every side stream waiting for the compute
stream before it is used, the tensors it reads marked for it, every gathered block bound only
after the compute stream waited for its gather's event, every reduced gradient read only after
its reduce-scatter's event, and ``comm_wait_s`` equal to the sum of the timed waits. The
schedule tests check on the CPU path that stage 3 issues the next block's gather before the
current block computes (forward and backward) and that a block's reduce-scatter is still
outstanding while the backward of the block before it runs.

Here: the gloo-world checks of this topic; its other tiers' checks are in
``tests/unit/test_runtime_overlap.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.fake_streams import FAKE_ELAPSED_S, FakeAPI
from tests.runtime_helpers import make_model, rank_batches
from tests.worlds import run_world
from zeropp.comm import QuantSpec, Topology
from zeropp.runtime import OptimizerConfig, ZeroConfig, ZeroEngine
from zeropp.runtime.streams import CommStreams


# ------------------------------------------------------------------ the engine under the fake
def _trace(rank: int, world: int, zero_kwargs: dict, steps: int) -> dict:
    """Train with and without (fake) streams; return results and the checks' counts."""
    out: dict[str, Any] = {}
    for fake in (False, True):
        zc = ZeroConfig(**zero_kwargs)
        eng = ZeroEngine(
            make_model(),
            config=zc,
            optimizer=OptimizerConfig(lr=1e-3),
            topology=Topology(nodes=1, ranks_per_node=world),
        )
        api = FakeAPI()
        log = api.log
        if fake:
            eng.comm.streams = CommStreams(eng.device, api=api)
            _instrument(eng, log)
        waits, losses = [], []
        for s in range(steps):
            r = eng.train_step(rank_batches(s, zc.grad_accum_steps, rank))
            losses.append(r.loss)
            waits.append(r.comm_wait_s)
            if fake:
                log.append(("step_end",))
        weights = {k: v.numpy() for k, v in eng.consolidated_state_dict().items()}
        eng.close()
        out["fake" if fake else "plain"] = {"losses": losses, "weights": weights}
        if fake:
            out["checks"] = _check_log(log, eng.comm.streams)
            out["waits"] = waits
    return out


def _instrument(eng: ZeroEngine, log: list) -> None:
    """Log gathers / reduce-scatters issued (by output buffer), binds, and gradient reads."""
    comm = eng.comm
    ag, rs = comm.all_gather, comm.reduce_scatter

    def all_gather(out, shard, **kw):
        log.append(("ag_issue", id(out), kw["async_op"]))
        return ag(out, shard, **kw)

    def reduce_scatter(out, full, **kw):
        log.append(("rs_issue", id(out), kw["async_op"]))
        return rs(out, full, **kw)

    comm.all_gather, comm.reduce_scatter = all_gather, reduce_scatter
    final = eng.reducer.final_grads

    def final_grads():
        log.append(("final_grads",))
        return final()

    eng.reducer.final_grads = final_grads
    for u in eng.units:
        bind = u.bind

        def logged_bind(buf, *views, _bind=bind):
            log.append(("bind", id(buf)))
            return _bind(buf, *views)

        u.bind = logged_bind


def _check_log(log: list, st: CommStreams) -> dict:
    sides = {s.name for s in st.streams.values()}
    n_ag = n_rs = n_bind = 0
    waited: set[int] = set()
    event_of: dict[int, int] = {}  # output buffer id -> event recorded for its collective
    for i, e in enumerate(log):
        if e[0] == "use" and e[1] in sides:
            # just before: the side stream waits for compute, then the tensors it reads are marked
            k = i - 1
            while log[k][0] == "record_stream":
                assert log[k][1] == e[1]
                k -= 1
            assert k < i - 1, f"{e[1]} used without marking the tensors it reads: {log[k : i + 1]}"
            assert log[k] == ("wait_stream", e[1], "compute"), (
                f"{e[1]} used without waiting for compute: {log[k : i + 1]}"
            )
        if e[0] == "wait_event":
            assert e[1] == "compute"
            waited.add(e[2])
        if e[0] in ("ag_issue", "rs_issue") and e[2]:  # async: find the event recorded on the side stream
            j = i + 1
            while not (log[j][0] == "record" and log[j][2] in sides):
                j += 1
            event_of[e[1]] = log[j][1]
            if e[0] == "ag_issue":
                n_ag += 1
            else:
                n_rs += 1
                # the gradient it reads was marked for the reduce-scatter stream before use
                k = j
                while log[k][0] != "use":
                    k -= 1
                assert log[k - 1][0] == "record_stream" and log[k - 1][1] == log[k][1]
        if e[0] == "bind" and e[1] in event_of:
            assert event_of[e[1]] in waited, "a gathered block was bound before its gather's event was waited"
            n_bind += 1
        if e[0] in ("final_grads", "step_end"):
            pending = [k for k in event_of.values() if k not in waited]
            assert not pending, f"events never waited by compute before {e[0]}: {pending}"
    return {"ag": n_ag, "rs": n_rs, "bind": n_bind}


CONFIGS = {
    "stage3": dict(stage=3, prefetch_depth=1),
    "stage3_zeropp": dict(stage=3, weights=QuantSpec(bits=8), grads=QuantSpec(bits=4), hpz=True),
    "stage2": dict(stage=2, reduce_bucket_size=300),
}


def _trace_all(rank: int, world: int, steps: int) -> dict:
    return {name: _trace(rank, world, kw, steps) for name, kw in CONFIGS.items()}  # one launch for all


@pytest.fixture(scope="module")
def traces() -> list[dict]:
    return run_world(_trace_all, 2, 2, timeout=300)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_engine_stream_ordering_under_fake_streams(traces: list[dict], name: str) -> None:
    for r in (t[name] for t in traces):
        assert r["fake"]["losses"] == r["plain"]["losses"], "streams changed the results"
        for k, v in r["plain"]["weights"].items():
            assert np.array_equal(v, r["fake"]["weights"][k]), k
        c = r["checks"]
        assert c["rs"] > 0 and c["ag"] > 0
        if name.startswith("stage3"):
            assert c["bind"] > 0
        # blocked time is the sum of the timed compute-stream waits (FAKE_ELAPSED_S each)
        assert all(w > 0 and abs(w / FAKE_ELAPSED_S - round(w / FAKE_ELAPSED_S)) < 1e-6 for w in r["waits"])


# ------------------------------------------------------------------ schedule (CPU path)
def _schedules(rank: int, world: int) -> tuple[dict, dict]:
    return _schedule(rank, world, 1), _schedule(rank, world, 0)  # one launch for both depths


def _schedule(rank: int, world: int, depth: int) -> dict:
    eng = ZeroEngine(make_model(), config=ZeroConfig(stage=3, prefetch_depth=depth), topology=Topology(1, world))
    st3 = eng.stage3
    units = st3.units
    fwd, bwd = [], []
    for i, (blk, _) in enumerate(eng.blocks):
        # runs after the engine's pre-hook (registered later): block i is about to compute
        blk.register_forward_pre_hook(
            lambda m, a, i=i: fwd.append((i, units[i].state, units[i + 1].state if i + 1 < len(units) else None))
        )
    pre = st3.pre_backward

    def pre_backward(i: int) -> None:
        pre(i)
        if i < 0:
            return
        # block i is about to run backward: its predecessor's gather and the reduce-scatter
        # of block i+1 (just finished) should both be in flight
        pending = {u.name: w.done for w, u, _ in eng.reducer._pending}
        nxt = units[i + 1].name if i + 1 < len(units) else None
        bwd.append(
            (i, units[i].state, units[i - 1].state if i > 0 else None, None if nxt is None else pending.get(nxt))
        )

    st3.pre_backward = pre_backward
    eng.train_step(rank_batches(0, 1, rank))
    eng.close()
    return {"fwd": fwd, "bwd": bwd}


def test_stage3_prefetches_ahead_and_leaves_reduce_scatters_in_flight() -> None:
    r1, r0 = run_world(_schedules, 2)[0]
    n = len(r1["fwd"])
    assert n >= 2
    # depth 1: when block i computes, block i+1's gather is already issued (in flight)
    assert r1["fwd"] == [(i, "ready", "inflight" if i + 1 < n else None) for i in range(n)]
    # depth 0: nothing is gathered ahead
    assert r0["fwd"] == [(i, "ready", "free" if i + 1 < n else None) for i in range(n)]
    # backward, last block first: block i-1 prefetched, block i+1's reduce-scatter not waited yet
    assert r1["bwd"] == [
        (i, "ready", "inflight" if i > 0 else None, False if i + 1 < n else None) for i in reversed(range(n))
    ]
    assert r0["bwd"] == [
        (i, "ready", "free" if i > 0 else None, False if i + 1 < n else None) for i in reversed(range(n))
    ]
