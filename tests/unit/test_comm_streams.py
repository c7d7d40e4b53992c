"""Buffer lifetimes across streams (``zeropp/comm/lifetime.py``) and the debug mode that shows
an early release on CPU (``ZEROPP_DEBUG_STREAMS=1``).

The fault: a communication buffer released (or handed back to a pool) while a collective or a
continuation on another stream still reads or writes it is silently overwritten by the next
allocation. On CPU nothing is really reused, so the debug mode poisons released buffers, keeps
poisoning them at every completion point while they are alive, and runs continuations late.
The checks, cheapest first:

- the pieces alone (one process): the poison values, what :class:`Buffers` poisons and what it
  never touches, the pool's LIFO reuse and poisoning, a handle's release order, the late start
  of continuations (and its bound), and the mode's teeth on one continuation: the same code with
  the buffer released at issue reads NaN;
- on a 2-node x 2-rank gloo world with the variable set by the launcher (``tests/streams_helpers.py``,
  run inside ``test_comm_overlap``'s 2x2 world, so it costs no launch of its own): outstanding and
  chunked hierarchical qgZ, the DDP hook and a stage-3 ZeRO++ engine step give the results of the
  run without the mode; with qgZ's hop-1 rows released at issue, or the engine's reduce-scatter
  output handed back to the pool before its wait, the same runs give wrong results.

Here: the one-process checks of this topic; its other tiers' checks are in ``tests/e2e/test_comm_streams.py``.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Iterator

import pytest
import torch

from zeropp.comm import chain, context, lifetime
from zeropp.comm.backend import CommHandle
from zeropp.comm.lifetime import Buffers
from zeropp.runtime.buffers import BufferPool

CPU = torch.device("cpu")


@pytest.fixture
def debug_ctx(monkeypatch: pytest.MonkeyPatch) -> Iterator[context.CommContext]:
    """This process's comm context replaced by one in debug mode (closed afterwards)."""
    ctx = context.CommContext(debug_streams=True)
    monkeypatch.setattr(context, "_CURRENT", ctx)
    yield ctx
    ctx.close()


# ------------------------------------------------------------------ the switch
def test_the_variable_is_read_when_the_context_is_created(monkeypatch: pytest.MonkeyPatch) -> None:
    for raw, want in (("", False), ("0", False), ("1", True), (" 1 ", True)):
        monkeypatch.setenv(context.DEBUG_ENV, raw)
        assert context.CommContext().debug_streams is want
    monkeypatch.delenv(context.DEBUG_ENV)
    assert context.CommContext().debug_streams is False
    monkeypatch.setenv(context.DEBUG_ENV, "yes")
    with pytest.raises(
        ValueError, match="ZEROPP_DEBUG_STREAMS='yes' is not a valid setting; set ZEROPP_DEBUG_STREAMS=1"
    ):
        context.CommContext()


# ------------------------------------------------------------------ poison, Buffers, the pool
def test_poison_writes_values_no_collective_produces() -> None:
    f32, bf16 = torch.zeros(3), torch.zeros(3, dtype=torch.bfloat16)
    u8, i32, b = torch.zeros(3, dtype=torch.uint8), torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.bool)
    for t in (f32, bf16, u8, i32, b):
        lifetime.poison(t)
    assert f32.isnan().all() and bf16.isnan().all()
    assert u8.tolist() == [0xFF] * 3 and i32.view(torch.uint8).tolist() == [0xFF] * 12 and b.all()


def test_release_poisons_only_our_buffers_and_drops_them(debug_ctx) -> None:
    inp, out = torch.arange(6.0), torch.zeros(6)
    ours = torch.ones(4)
    gone = weakref.ref(ours)
    hold = Buffers(ours, inp.view(2, 3), out[:2], protect=(inp, out))  # views of the caller's tensors
    del ours
    assert len(hold) == 3 and gone() is not None  # held until released
    hold.release()
    assert gone() is None and len(hold) == 0  # nothing of ours kept alive
    assert inp.tolist() == list(map(float, range(6))) and not out.isnan().any()  # the caller's: untouched
    kept = torch.ones(4)
    Buffers(kept).release()
    assert kept.isnan().all()  # a reference someone kept (the bug): poisoned


def test_release_outside_the_debug_mode_only_drops(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = context.CommContext(debug_streams=False)
    monkeypatch.setattr(context, "_CURRENT", ctx)
    kept = torch.ones(4)
    Buffers(kept).release()
    lifetime.completed()
    assert kept.tolist() == [1.0] * 4


def test_a_released_buffer_still_alive_is_poisoned_again_at_every_completion(debug_ctx) -> None:
    kept = torch.ones(4)
    Buffers(kept).release()
    kept.fill_(2.0)  # e.g. a collective still writing it after the early release
    lifetime.completed()  # a wait returned: the memory "went to new work"
    assert kept.isnan().all()


def test_pool_reuses_the_last_given_back_slot_and_poisons_free_ones(debug_ctx) -> None:
    pool = BufferPool(torch.float32, CPU)
    pool.reserve("r", 3, 8)
    a, b = pool.acquire("r", 8), pool.acquire("r", 8)
    a.fill_(1.0), b.fill_(2.0)
    pool.give_back(a)
    pool.give_back(b)
    assert a.isnan().all() and b.isnan().all()  # given back: poisoned
    c = pool.acquire("r", 5)
    assert c.data_ptr() == b.data_ptr()  # LIFO: the slot given back last is reused first
    c.fill_(3.0)
    lifetime.completed()
    assert c.tolist() == [3.0] * 5 and a.isnan().all()  # handed out again: no longer poisoned
    a.fill_(4.0)  # a user still writing the slot it gave back
    lifetime.completed()
    assert a.isnan().all()


class _Work:
    """A backend work whose wait() records that it ran, or raises."""

    def __init__(self, log: list, fail: bool = False) -> None:
        self.log, self.fail = log, fail

    def wait(self) -> bool:
        if self.fail:
            raise RuntimeError("peer gone")
        self.log.append("wait")
        return True


def test_a_handle_releases_its_buffers_after_its_post_processing(debug_ctx) -> None:
    log, recv, out = [], torch.full((4,), 5.0), torch.zeros(4)
    h = CommHandle([_Work(log)], lambda: (log.append("finish"), out.copy_(recv)), Buffers(recv, protect=(out,)))
    assert not recv.isnan().any()  # nothing released at issue
    h.wait()
    assert log == ["wait", "finish"] and out.tolist() == [5.0] * 4 and recv.isnan().all()
    held = torch.ones(2)
    bad = CommHandle([_Work(log, fail=True)], None, Buffers(held))
    with pytest.raises(RuntimeError, match="peer gone"):
        bad.wait()
    assert held.tolist() == [1.0, 1.0]  # a failed backend wait keeps them: the backend may still use them


# ------------------------------------------------------------------ late continuations
def test_a_continuation_runs_only_after_the_caller_moved_on(debug_ctx) -> None:
    debug_ctx.late_s = 30.0
    ran = threading.Event()
    first = chain.submit(ran.set, CPU)
    assert not ran.wait(0.3)  # the caller has not moved on yet
    second = chain.submit(lambda: None, CPU)  # its next submission
    assert ran.wait(10)
    second.wait()
    first.wait()


def test_a_continuation_nobody_prompts_still_runs_after_late_s(debug_ctx) -> None:
    debug_ctx.late_s = 0.2
    ran = threading.Event()
    t0 = time.monotonic()
    chain.submit(ran.set, CPU)
    assert ran.wait(10) and time.monotonic() - t0 >= 0.15  # no peer waits forever for it


def _copy_through_a_continuation(early: bool) -> torch.Tensor:
    """A buffer of ours read by a continuation; ``early``: released at issue (the bug)."""
    buf, out = torch.arange(8.0), torch.empty(8)
    hold = Buffers(buf)
    job = lambda src=buf: out.copy_(src)  # noqa: E731 - the continuation reads the buffer
    if early:
        hold.release()
        later = chain.submit(job, CPU)
    else:
        later = chain.submit(job, CPU, buffers=hold)
    del buf  # the caller's reference is gone at once
    later.wait()
    return out


def test_the_debug_mode_shows_a_buffer_released_at_issue(debug_ctx) -> None:
    assert _copy_through_a_continuation(early=False).tolist() == list(map(float, range(8)))
    assert _copy_through_a_continuation(early=True).isnan().all()
