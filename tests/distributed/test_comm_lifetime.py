"""A process that used the collectives ends cleanly (``zeropp/comm/context.py``).

Here: the gloo-world checks. The topic's full description and its one-process checks are in
``tests/unit/test_comm_lifetime.py``; its end-to-end checks are in
``tests/e2e/test_comm_lifetime.py``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.worlds import run_world
from zeropp.comm import Topology, chain, context
from zeropp.comm.backend import backend_all_gather, backend_all_reduce, backend_all_to_all, backend_reduce_scatter
from zeropp.experiments.launch import RankFailure, launch_world

CPU = torch.device("cpu")


# ------------------------------------------------------------------ on a gloo world
CALLS = {
    "all_to_all": lambda out, inp, raw: (
        dist.all_to_all_single(out, inp) if raw else backend_all_to_all(out, inp, None, False)
    ),
    "all_gather": lambda out, inp, raw: (
        dist.all_gather_single(out, inp[:4]) if raw else backend_all_gather(out, inp[:4], None, False)
    ),
    "reduce_scatter": lambda out, inp, raw: (
        dist.reduce_scatter_single(out[:4], inp)
        if raw
        else backend_reduce_scatter(out[:4], inp, dist.ReduceOp.SUM, None, False)
    ),
    "all_reduce": lambda out, inp, raw: (
        dist.all_reduce(out) if raw else backend_all_reduce(out, dist.ReduceOp.SUM, None, False)
    ),
}


def _freeing_threads(rank: int, world: int, iters: int) -> dict:
    """For raw torch.distributed calls and zeropp's backend calls on fresh temporaries dropped
    right after the call: how many of their Python objects were freed off the main thread."""
    main = threading.get_native_id()
    res = {}
    for raw in (True, False):
        for name, call in CALLS.items():
            freed: list[int] = []
            for i in range(iters):
                inp = torch.full((4 * world,), float(i))
                out = torch.empty(4 * world)
                weakref.finalize(inp, lambda f=freed: f.append(threading.get_native_id()))
                weakref.finalize(out, lambda f=freed: f.append(threading.get_native_id()))
                call(out, inp, raw)
                del inp, out
            assert context.current().close(timeout=30)
            deadline = time.monotonic() + 10
            while len(freed) < 2 * iters and time.monotonic() < deadline:
                time.sleep(0.01)
            res[("raw" if raw else "zeropp", name)] = (sum(t != main for t in freed), len(freed))
    return res


def test_backend_threads_never_free_python_objects_of_zeropp_calls() -> None:
    results = run_world(_freeing_threads, 2, 100)
    for res in results:
        for name in CALLS:
            off_main, total = res[("zeropp", name)]
            assert total == 200 and off_main == 0, (name, res)
    raw_off_main = sum(r[("raw", n)][0] for r in results for n in CALLS)
    print(
        f"reference: raw torch.distributed calls had {raw_off_main} of {2 * 200 * len(CALLS)} Python objects "
        "freed on gloo's threads"
    )


def _restart(rank: int, world: int, store: str) -> dict:
    ctx = context.current()
    topo = Topology(world, 1)
    old_groups = topo.build()
    t = torch.full((3,), float(rank + 1))
    chain.submit(lambda: backend_all_reduce(t, dist.ReduceOp.SUM, old_groups.cross, False), CPU).wait()
    first_sum = t.tolist()
    worker = ctx._thread
    alive_before = worker is not None and worker.is_alive()
    dist.destroy_process_group()  # torch drops the world: the worker is drained and joined
    stopped = worker is not None and not worker.is_alive() and not ctx.worker_alive
    try:
        _ = old_groups.cross
        stale = "no error"
    except RuntimeError as e:
        stale = str(e)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    groups = topo.build()  # rebuilt in the new world, not the stale cache
    u = torch.full((3,), 10.0 * (rank + 1))
    handle = chain.submit(lambda: backend_all_reduce(u, dist.ReduceOp.SUM, groups.cross, False), CPU)
    handle.wait()
    return {
        "first": first_sum,
        "alive_before": alive_before,
        "stopped": stopped,
        "stale": stale,
        "second": u.tolist(),
        "new_worker": ctx._thread is not worker and ctx.worker_alive,
        "rebuilt": groups is not old_groups,
    }


def test_destroy_then_init_again_restarts_the_worker(tmp_path: Path) -> None:
    for r in run_world(_restart, 2, str(tmp_path / "store")):
        assert r["first"] == [3.0] * 3 and r["second"] == [30.0] * 3, r
        assert r["alive_before"] and r["stopped"] and r["new_worker"] and r["rebuilt"], r
        assert "was destroyed (destroy_process_group)" in r["stale"] and "build() again" in r["stale"], r


# ------------------------------------------------------------------ a rank that leaves alone
def _leave_alone(rank: int, world: int, note: str) -> None:
    """Rank 0 issues an all-reduce rank 1 never joins and fails (as on any error of its own, or a
    SIGTERM), with that work in flight; rank 1 waits in a collective on another group, which
    rank 0 never issues, and notes how its wait ended."""
    if rank == 1:
        # the launcher's stop (SIGTERM, once rank 0 failed) must not decide how the wait ends: only rank
        # 0's exit may end it here; were it still blocked, the stop's SIGKILL after grace_s leaves no note.
        # Ignored before the group below: rank 0 can fail as soon as that group exists, and a loaded
        # machine may not schedule this rank again before the launcher's SIGTERM arrives
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sub = dist.new_group(list(range(world)))
    # Both ranks past the group's set-up before rank 0 leaves: rank 1's new_group may still be reading
    # the store rank 0 hosts when rank 0's returns, and would fail there instead of in the wait below.
    dist.barrier()
    if rank == 0:
        backend_all_reduce(torch.ones(8), dist.ReduceOp.SUM, None, True)  # in flight, never joined
        raise RuntimeError("rank 0 fails with a collective in flight")
    try:
        dist.all_reduce(torch.ones(3), group=sub)
        Path(note).write_text("returned")
    except RuntimeError as e:
        Path(note).write_text(str(e))
        raise


def test_a_rank_failing_with_work_in_flight_unblocks_its_peer_at_once(tmp_path: Path) -> None:
    """The failing rank aborts its groups instead of destroying them (``abort_process_groups``),
    so it exits at once and its peer's wait fails with a closed connection; the world reports
    rank 0's error. Destroying them would wait, in C++, for the issued all-reduce until the
    group's timeout (120 s here), so the peer would stay blocked until the run's 60 s limit."""
    note = tmp_path / "rank1"
    with pytest.raises(RankFailure) as failure:
        launch_world(
            _leave_alone,
            2,
            args=(str(note),),
            process_group="gloo",
            pg_timeout_s=120,
            timeout_s=60,
            grace_s=30,
            threads=1,
            start_method="forkserver",
        )
    assert failure.value.rank == 0 and "fails with a collective in flight" in str(failure.value), failure.value
    text = note.read_text().lower()  # unblocked by rank 0's exit (gloo says closed or reset), not killed
    assert "closed" in text or "reset by peer" in text, text


def test_a_module_rank_aborting_with_a_continuation_in_flight_exits_at_once(tmp_path: Path) -> None:
    """The runner's ranks exit the normal way (atexit hooks, finalization): with the comm worker
    waiting on the aborted work, the exit neither joins that worker (30 s) nor destroys the
    aborted groups (a destructor that waits until the group's timeout, 120 s here, then
    ``terminate called``, exit 134). Rank 0 exits 1 at once; its peer's wait fails with a closed
    connection within seconds."""
    store, note = tmp_path / "store", tmp_path / "note"
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.abort_rank", str(r), str(store), str(note)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=Path(__file__).resolve().parents[2],
        )
        for r in (0, 1)
    ]
    try:
        codes = [p.wait(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = [p.stdout.read() if p.stdout else "" for p in procs]
    assert codes == [1, 0], (codes, logs)
    assert "terminate called" not in logs[0] and "did not finish" not in logs[0], logs[0]
    seconds, _, error = note.read_text().partition(" ")
    error = error.lower()  # gloo says closed or reset, depending on which side of the socket saw it first
    assert ("closed" in error or "reset by peer" in error) and float(seconds) < 30, note.read_text()


def _abort_then_init_again(rank: int, world: int, store: str) -> dict:
    ctx = context.current()
    t = torch.full((3,), float(rank + 1))
    chain.submit(lambda: backend_all_reduce(t, dist.ReduceOp.SUM, None, False), CPU).wait()
    aborted = context.abort_process_groups()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    u = torch.full((3,), 10.0 * (rank + 1))
    chain.submit(lambda: backend_all_reduce(u, dist.ReduceOp.SUM, None, False), CPU).wait()
    alive = ctx.worker_alive
    dist.destroy_process_group()  # the new world's destroy stops the new worker
    return {
        "aborted": aborted,
        "first": t.tolist(),
        "second": u.tolist(),
        "alive": alive,
        "stopped": not ctx.worker_alive,
    }


def test_after_an_abort_a_new_world_gets_a_worker_its_destroy_stops(tmp_path: Path) -> None:
    for r in run_world(_abort_then_init_again, 2, str(tmp_path / "store")):
        assert r["aborted"] and r["first"] == [3.0] * 3 and r["second"] == [30.0] * 3, r
        assert r["alive"] and r["stopped"], r
