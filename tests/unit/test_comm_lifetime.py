"""A process that used the collectives ends cleanly (``zeropp/comm/context.py``).

The fault users met: a torchrun script of README's shape printed correct results, then one rank
died of SIGABRT ("terminate called without an active exception"): 9 of 20 runs of
``tests/data/readme_collectives.py`` on 4 ranks (8 of 20 with ``destroy_process_group()``), because a gloo worker thread freed the Python object of a collective's temporary buffer
while the interpreter was finalizing. The checks, cheapest first:

- the comm context on its own: close() drains and joins the worker (bounded, with a warning),
  the next continuation starts a new one, and buffers the backend still references are held;
- on a gloo world: no Python object handed to the backend through zeropp is ever freed by a gloo
  thread (a weakref finalizer records the freeing thread; raw ``torch.distributed`` calls are the
  reference that shows such frees happen), and destroy_process_group then a new
  init_process_group stops the worker and starts a fresh one that serves the new world;
- the user's script itself (``tests/data/readme_collectives.py``, 4 ranks as 2 nodes of 2) under
  torchrun, several times, every other run ending with ``destroy_process_group()``: every run
  exits 0. ``ZEROPP_TORCHRUN_RUNS`` sets how many (default 2, one without and one with
  ``destroy_process_group()``; the acceptance bar is 20).

Here: the one-process checks of this topic; its other tiers' checks are in
``tests/distributed/test_comm_lifetime.py``, ``tests/e2e/test_comm_lifetime.py``.
"""

from __future__ import annotations

import threading
import time
import weakref
from pathlib import Path

import pytest
import torch

from zeropp.comm import context


# ------------------------------------------------------------------ the context alone
def test_close_drains_joins_and_the_next_continuation_restarts_the_worker() -> None:
    ctx = context.CommContext()
    gate, ran = threading.Event(), []
    ctx.submit(lambda: (gate.wait(10), ran.append(1)))
    ctx.submit(lambda: ran.append(2))
    first = ctx._thread
    threading.Timer(0.2, gate.set).start()
    assert ctx.close(timeout=30) and ran == [1, 2]  # everything queued ran before the join
    assert first is not None and not first.is_alive() and not ctx.worker_alive
    assert ctx.close()  # idempotent
    done = threading.Event()
    ctx.submit(done.set)
    assert done.wait(10) and ctx.worker_alive and ctx._thread is not first
    ctx.close()


def test_a_continuation_finishing_after_close_still_nests_inline() -> None:
    ctx = context.CommContext()
    gate, seen = threading.Event(), []
    ctx.submit(lambda: (gate.wait(10), seen.append(ctx.in_worker())))
    threading.Timer(0.2, gate.set).start()
    assert ctx.close(timeout=30)
    assert seen == [True] and not ctx.worker_alive  # no second worker was started for it


def test_close_is_bounded_and_says_what_it_left() -> None:
    ctx = context.CommContext()
    gate = threading.Event()
    ctx.submit(lambda: gate.wait(30))
    start = time.monotonic()
    with pytest.warns(RuntimeWarning, match="did not finish its queued continuations within 0 s"):
        assert not ctx.close(timeout=0.2)
    assert time.monotonic() - start < 5
    gate.set()


def test_close_from_a_continuation_does_not_deadlock() -> None:
    ctx = context.CommContext()
    out = []
    ctx.submit(lambda: out.append(ctx.close(timeout=5)))
    deadline = time.monotonic() + 10
    while not out and time.monotonic() < deadline:
        time.sleep(0.01)
    assert out == [True]


def _issued_and_dropped(ctx: context.CommContext) -> tuple[list[torch.Tensor], list[str]]:
    """Hand ``ctx`` a tensor that a stand-in backend keeps referenced (a view made during the call,
    as gloo's work holds the tensor's C++ object), then drop the caller's reference. Returns the
    backend's references (clear them to release) and the list ``"t"`` lands in once it is freed."""
    backend_refs: list[torch.Tensor] = []
    t = torch.zeros(4)
    ctx.issue(lambda: backend_refs.append(t.view(-1)), [t])  # noqa: F821 (called here, before `del t`)
    freed: list[str] = []
    weakref.finalize(t, freed.append, "t")
    del t
    return backend_refs, freed


def test_buffers_still_referenced_by_the_backend_are_held_until_released() -> None:
    """A stand-in for the backend's reference: a view made during the call holds the tensor's
    C++ object the way gloo's work does; the context keeps the Python object until it is gone."""
    ctx = context.CommContext()
    backend_refs, freed = _issued_and_dropped(ctx)
    assert ctx.held == 1 and not freed  # our reference keeps the Python object alive
    backend_refs.clear()
    assert ctx.held == 0 and freed == ["t"]
    u = torch.zeros(2)
    keep = ctx.issue(lambda: u.view(-1), [u])
    with pytest.warns(RuntimeWarning, match="1 tensor.* still referenced after 0 s"):
        assert not ctx.close(timeout=0.05)
    del keep


def test_keep_held_ends_the_wait_and_keeps_the_tensors_alive(recwarn: pytest.WarningsRecorder) -> None:
    """After an abort the backend may never release what it holds: ``keep_held`` stops the wait
    (close returns at once, clean, no warning) and the tensors stay referenced by the context, so
    a late release by the backend is still never the last one."""
    ctx = context.CommContext()
    backend_refs, freed = _issued_and_dropped(ctx)
    assert ctx.keep_held() == 1 and ctx.held == 0
    assert ctx.close(timeout=30) and not recwarn.list
    backend_refs.clear()  # the backend lets go late: the context's reference remains
    assert not freed
    assert ctx.keep_held() == 0


# ------------------------------------------------------------------ backend threads at exit
def _named_thread(name: str, busy: threading.Event, stop: threading.Event) -> threading.Thread:
    """A thread that gives itself the Linux name ``name`` (as gloo's workers are named), then
    spins while ``busy`` is set and sleeps otherwise, until ``stop``."""
    import ctypes

    def run() -> None:
        ctypes.CDLL(None).prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME
        while not stop.is_set():
            if busy.is_set():
                sum(range(1000))  # runnable: state R
            else:
                stop.wait(0.05)  # asleep: state S

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread states from Linux /proc")
def test_exit_waits_for_backend_threads_to_go_idle_and_gives_up_in_bounded_time(monkeypatch) -> None:
    monkeypatch.setattr(context, "_BACKEND_THREADS", frozenset({"zpp_test_gloo"}))
    busy, stop = threading.Event(), threading.Event()
    busy.set()
    t = _named_thread("zpp_test_gloo", busy, stop)
    try:
        time.sleep(0.1)
        start = time.monotonic()
        assert not context._backend_threads_settle(timeout=0.3)  # a thread still running: bounded wait
        assert 0.3 <= time.monotonic() - start < 2.0
        threading.Timer(0.2, busy.clear).start()
        start = time.monotonic()
        assert context._backend_threads_settle(timeout=5.0)  # settles once it sleeps
        assert 0.15 <= time.monotonic() - start < 4.0
    finally:
        stop.set()
        t.join(5)
    assert context._backend_threads_settle(timeout=0.1)  # none left: at once
