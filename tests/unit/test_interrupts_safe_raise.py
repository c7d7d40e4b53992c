"""A signal handler's exception never lands inside a lock's own code (``zeropp.interrupts.raise_when_safe``).

Python runs a handler between two bytecodes of the main thread; an exception raised in
``threading.Condition.__exit__`` before its release leaves the lock held, and every later
``Event.set`` on it (a rank's heartbeat during its stop) blocks forever. These tests put the
handler exactly there: a profile hook calls it with the frame of ``Condition.__enter__`` /
``__exit__`` as the interpreter would, deterministically, and check that the exception comes out
in the caller with the lock released; a real signal during a blocking wait still stops the wait.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import pytest
from torch.distributed.elastic.multiprocessing import SignalException

from zeropp.interrupts import Terminated, raise_when_safe, sigterm_raises

pytestmark = pytest.mark.unit


class Stop(Exception):
    pass


def _interrupt_in(code: Any, event: str, handler: Callable[[FrameType], None]) -> Callable[..., None]:
    """A profile hook that calls ``handler`` with the frame of ``code`` at its first ``event``
    (``call``: before its first bytecode; ``return``: after its last), as a signal landing there would."""
    armed = [True]

    def hook(frame: FrameType, ev: str, arg: object) -> None:
        if armed[0] and ev == event and frame.f_code is code:
            armed[0] = False
            handler(frame)

    return hook


@pytest.fixture
def profiled() -> Iterator[Callable[[Callable[..., None]], None]]:
    def install(hook: Callable[..., None]) -> None:
        sys.setprofile(hook)

    yield install
    sys.setprofile(None)


def _beat(ev: threading.Event) -> str:
    ev.set()  # a heartbeat's beat: the signal lands inside
    return "after the beat"


def _raise_stop(frame: FrameType) -> None:
    raise_when_safe(frame, Stop("stopped"))


@pytest.mark.parametrize(
    ("code", "event"),
    [(threading.Condition.__exit__.__code__, "call"), (threading.Condition.__enter__.__code__, "return")],
    ids=["before Condition.__exit__ releases", "after Condition.__enter__ acquired"],
)
def test_an_exception_for_a_signal_inside_a_lock_comes_out_after_the_lock_is_released(
    code: Any, event: str, profiled: Callable[[Callable[..., None]], None]
) -> None:
    ev = threading.Event()
    profiled(_interrupt_in(code, event, _raise_stop))
    with pytest.raises(Stop) as info:
        _beat(ev)
    sys.setprofile(None)
    assert not ev._cond._lock.locked()  # type: ignore[attr-defined]
    assert info.traceback[-2].name == "_beat"  # raised in the caller, once out of threading's code
    assert ev.is_set()  # the interrupted set() ran to its end
    done = threading.Event()
    threading.Thread(target=lambda: (ev.clear(), ev.set(), done.set()), daemon=True).start()
    assert done.wait(30), "the Event's lock stayed held: the next set() blocks"
    assert sys.gettrace() is None


def test_raised_at_once_where_safe_and_no_trace_function_is_left(
    profiled: Callable[[Callable[..., None]], None],
) -> None:
    with pytest.raises(Stop):  # an ordinary frame (and no frame at all): at once
        raise_when_safe(sys._getframe(), Stop())
    with pytest.raises(Stop):
        raise_when_safe(None, Stop())
    stack = []
    f: FrameType | None = sys._getframe()
    while f is not None:
        stack.append(f)
        f = f.f_back
    before = [g.f_trace for g in stack]
    profiled(_interrupt_in(threading.Condition.__exit__.__code__, "call", _raise_stop))
    with pytest.raises(Stop):
        _beat(threading.Event())
    sys.setprofile(None)
    assert sys.gettrace() is None
    assert [g.f_trace for g in stack] == before  # the frames' own trace functions as they were


def test_a_signal_during_a_blocking_wait_stops_the_wait() -> None:
    """``Condition.wait`` copes with an exception in its blocking acquire: raised there at once,
    not deferred until the wait ends (an ``Event`` nobody sets would have held the stop forever)."""
    never = threading.Event()
    before = signal.getsignal(signal.SIGTERM)
    with sigterm_raises():
        timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM))
        timer.start()
        try:
            with pytest.raises(Terminated):
                never.wait(60)
        finally:
            timer.cancel()
    assert signal.getsignal(signal.SIGTERM) == before
    assert not never._cond._lock.locked()  # type: ignore[attr-defined]


def test_the_ranks_sigterm_handler_defers_out_of_the_heartbeats_event(
    profiled: Callable[[Callable[..., None]], None],
) -> None:
    """The runner's rank handler (``worker._raise_on_sigterm``), given the frame of the heartbeat's
    ``Event.set`` as a SIGTERM landing there gives it: its ``SignalException`` comes out of the
    beat with the Event usable, so the rank's stop can beat again on its way out."""
    from zeropp import watch
    from zeropp.experiments.runner import worker

    publisher = watch._Publisher("/nonexistent", 1, 1.0)  # not started: its beat only sets the Event
    before = signal.getsignal(signal.SIGTERM)
    try:
        profiled(
            _interrupt_in(
                threading.Condition.__exit__.__code__, "call", lambda f: worker._raise_on_sigterm(signal.SIGTERM, f)
            )
        )
        with pytest.raises(SignalException, match="stopped by SIGTERM"):
            publisher.beat("train_step", 3, False)
        sys.setprofile(None)
        assert not publisher.wake._cond._lock.locked()  # type: ignore[attr-defined]
    finally:
        signal.signal(signal.SIGTERM, before)
        worker._stopped_by.clear()
        worker._stack_log.clear()


_LOCKED_SECTION = """
def locked_section(interrupt, finalizer):
    interrupt()  # the signal lands in this frame
    finalizer()  # code this section calls meanwhile, as a finalizer the garbage collector runs
    return "section done"
"""


def test_a_function_called_meanwhile_runs_to_its_end_and_the_stop_comes_after(monkeypatch: pytest.MonkeyPatch) -> None:
    """A deferred exception is raised only in a frame of the interrupted stack: a function the
    unsafe code calls meanwhile (a finalizer, whose exception Python would print and swallow, losing
    the stop) runs to its end, and the exception comes out once the section has returned."""
    from zeropp import interrupts

    ns: dict[str, Any] = {}
    exec(compile(_LOCKED_SECTION, "<synchronisation code>", "exec"), ns)
    monkeypatch.setattr(interrupts, "_SYNC_FILES", frozenset({"<synchronisation code>"}))
    ran: list[str] = []

    def finalizer() -> None:
        ran.append("started")
        ran.append("finished")

    def caller() -> str:
        return ns["locked_section"](lambda: raise_when_safe(sys._getframe(1), Stop()), finalizer)

    with pytest.raises(Stop) as info:
        caller()
    assert ran == ["started", "finished"]
    assert not {"finalizer", "locked_section"} & {e.name for e in info.traceback}  # raised once the section returned
    assert sys.gettrace() is None
