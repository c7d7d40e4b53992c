"""Ctrl-C or SIGTERM while one of our commands is still importing (torch, triton, Hydra: a second or more).

Every ``python -m experiments.X`` / ``python -m zeropp.X`` command turns an interrupt into one
``error:`` line and exit status 130 once its ``main`` runs (``experiments.launch.command``), but
the imports before it are outside any handler, so a Ctrl-C in the first second printed Python's
traceback through ``importlib`` and torch's modules, and one that landed in the numpy import
torch's C code makes was swallowed there and the command ran on as if not interrupted.
:func:`quiet_interrupts_while_importing`, called by the packages' ``__init__`` when the process
was started as ``python -m`` one of our modules, installs a SIGINT handler that, while the
command's start-up imports run (the imports of its ``__main__`` module's body, or of runpy before
it), prints that one line and ends the process by SIGINT itself, as Python does for an uncaught
``KeyboardInterrupt`` (the shell sees 130): an exception could be swallowed by a C-level import,
and nothing of the command exists yet to clean up. Anywhere else (a lazy import inside ``main``,
ordinary code) it raises ``KeyboardInterrupt`` as Python's own handler does, so the commands'
own handling is unchanged. A user's script that imports zeropp keeps Python's handler.

SIGTERM (``timeout``, ``kill``, a scheduler's preemption) ended such a command silently in its
first seconds: until the command's own handler is in place (``sigterm_raises``), Python leaves
SIGTERM to the kernel. The same handler takes it while SIGTERM still has that default
disposition: one line (``error: interrupted by SIGTERM while starting; stopped``, or without
"while starting" once the imports are done and before the command's handler takes over) and
death by SIGTERM (the shell sees 143), as the default would have ended it. A process that is a
rank of a world (``RANK`` in its environment other than 0, or a rank of our own launcher,
:data:`LAUNCHED_MARK`) stops without the line: its launcher reports the stop once (the runner's
``all ranks stopped``; under torchrun rank 0's line). As a namespace's init (PID 1), which the
kernel does not end with a default-handled signal, the process exits 128 + the signal instead.

The stand-in is a Python-level handler, and Python runs those only between bytecodes of the main
thread: while that thread waits in C (a gloo collective, a rendezvous, a lock in an extension) a
SIGTERM under the stand-in waits with it, where the default disposition ends the process at once.
So it holds only through start-up: :func:`end_start_up`, called where a command's own code takes
over (``sigterm_raises``, which ``run_command`` and the runner use, and the entry points of ranks
and of the commands that install no handler), gives SIGTERM back its default disposition and
SIGINT Python's handler.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import inspect
import os
import queue
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

__all__ = [
    "LAUNCHED_MARK",
    "Terminated",
    "end_start_up",
    "interrupt_when_safe",
    "quiet_interrupts_while_importing",
    "raise_when_safe",
    "run_as_module",
    "sigterm_raises",
]

LAUNCHED_MARK = "ZEROPP_LAUNCHED_RANK"
"""Set in ranks our launcher starts (``experiments.launch``): the launcher, not the rank, reports their
stop, and a rank never mistakes itself for a torchrun rank that should spawn."""


def run_as_module(argv: list[str]) -> str | None:
    """The module name of ``python [options] -m MODULE ...`` in ``argv`` (``sys.orig_argv``: the
    interpreter's own command line), or None when it ran a script, ``-c`` or a REPL."""
    i = 1
    while i < len(argv):
        a = argv[i]
        if a == "-m":
            return argv[i + 1] if i + 1 < len(argv) else None
        if a.startswith("-m"):
            return a[2:]
        if a in ("-c", "-") or not a.startswith("-"):
            return None  # a command, stdin or a script: what follows belongs to it
        i += 2 if a in ("-W", "-X", "--check-hash-based-pycs") else 1  # these take the next token
    return None


def _starting(frame: FrameType | None) -> bool:
    """Whether the interrupted code runs in a start-up import: the outermost import on the stack
    was made by the ``__main__`` module's body (or by runpy locating it), not from a function."""
    caller = None
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            caller = frame.f_back  # the code that made this import; the last one seen is the outermost
        frame = frame.f_back
    if caller is None:
        return False
    where = caller.f_code.co_filename
    if where == "<frozen runpy>" or os.path.basename(where) == "runpy.py":  # (runpy is frozen from 3.11)
        return True
    return caller.f_code.co_name == "<module>" and caller.f_globals.get("__name__") == "__main__"


def _reports_stops() -> bool:
    """Whether this process says that a signal stopped it: not when it is a rank another process
    started and reports for (a rank of our launcher, or a torchrun rank other than rank 0)."""
    return LAUNCHED_MARK not in os.environ and os.environ.get("RANK", "0") == "0"


def _stop(sig: signal.Signals, line: str) -> None:
    """Say ``line`` (when :func:`_reports_stops`) and end the process by ``sig`` itself: an
    exception could be swallowed by a C-level import, and nothing of the command exists yet to
    clean up. Returns only where the kernel ignores the signal (PID 1), by raising SystemExit."""
    if _reports_stops():
        with contextlib.suppress(OSError):  # a closed stderr must not stop the stop
            print(line, file=sys.stderr, flush=True)
    handler = signal.getsignal(sig)
    signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
    # still here: the process is a namespace's init (PID 1 in a container), which the kernel does
    # not end with a default-handled signal. Our handler back, so a later signal still counts.
    signal.signal(sig, handler)
    raise SystemExit(128 + sig)


_installed_by: list[int] = []  # the pid that installed the handler (a forked child inherits it)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    sig = signal.Signals(signum)
    if os.getpid() not in _installed_by:  # a forked child (a data loader's worker): Python's defaults
        if sig == signal.SIGINT:
            raise KeyboardInterrupt
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        return
    if _starting(frame):
        _stop(sig, f"error: interrupted by {sig.name} while starting; stopped")
    if sig == signal.SIGINT:
        raise KeyboardInterrupt  # as Python's own handler: the command's handling decides
    # SIGTERM with no handler of the command's in place (before it installs one, or after): where
    # the default disposition would have ended the process without a word
    _stop(sig, f"error: interrupted by {sig.name}; stopped")


def stands_in_for_sigterms_default(handler: object) -> bool:
    """``handler`` is this module's SIGTERM handler, installed in place of the default disposition
    (module doc): code that chains to the previous SIGTERM handler after its own clean-up treats it
    as the default, and ends in its own words rather than this module's generic line."""
    return handler is _on_signal


def quiet_interrupts_while_importing(package: str) -> None:
    """Install the handler (module doc) when this process is ``python -m package.X`` (``package``:
    the calling package's own name, ``zeropp`` or ``experiments``) and this is the main thread
    (only it may set handlers): for SIGINT while it still has Python's default handler, for
    SIGTERM while it still has the default disposition (an ignored SIGTERM stays ignored);
    otherwise nothing. A user's ``python -m their_pkg.train`` that imports zeropp keeps Python's
    handlers."""
    module = run_as_module(list(getattr(sys, "orig_argv", [])))
    if module is None or not (module == package or module.startswith(package + ".")):
        return
    if threading.current_thread() is not threading.main_thread():
        return
    _installed_by[:] = [os.getpid()]
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_signal)
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_signal)


def end_start_up() -> None:
    """The command's own code runs from here: where the stand-in still holds SIGTERM, SIGTERM gets
    its default disposition back (the kernel ends the process at once, also while the main thread
    waits in C, which a Python-level handler cannot), and SIGINT Python's own handler. A handler
    installed since (the command's) is left alone. Only the main thread may set handlers; elsewhere,
    and where the stand-in was never installed, nothing."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is _on_signal:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if signal.getsignal(signal.SIGINT) is _on_signal:
        signal.signal(signal.SIGINT, signal.default_int_handler)


class Terminated(BaseException):
    """SIGTERM arrived (``timeout``, a scheduler's preemption, ``kill``): raised in the main thread
    like Python's ``KeyboardInterrupt`` for SIGINT, so that ``finally`` blocks and context managers
    run (a benchmark's scratch files are removed, a world's ranks are stopped) instead of the
    process ending on the spot."""


_SYNC_FILES = frozenset(
    inspect.getfile(x) for x in (threading, queue, concurrent.futures.Future, concurrent.futures.ThreadPoolExecutor)
)
"""The standard library's pure-Python synchronisation: ``threading.Condition`` (under ``Event``,
``Semaphore``, ``Barrier``), ``queue.Queue`` and ``concurrent.futures``' futures."""

_WAITS = frozenset({"wait", "wait_for", "join", "_wait_for_tstate_lock", "get", "put", "result", "exception"})
"""Their blocking waits, written to be interrupted (``KeyboardInterrupt`` in the blocking acquire
leaves their lock as it found it): a signal that finds the main thread blocked there stops it there."""


def _unsafe(frame: FrameType | None) -> bool:
    """Whether an exception raised in ``frame`` may leave a lock held: ``frame`` runs the standard
    library's synchronisation code (:data:`_SYNC_FILES`) outside its blocking waits, for example
    ``Condition.__exit__`` before it releases the lock, or ``__enter__`` after acquiring it."""
    return frame is not None and frame.f_code.co_filename in _SYNC_FILES and frame.f_code.co_name not in _WAITS


def raise_when_safe(frame: FrameType | None, exc: BaseException) -> None:
    """Raise ``exc`` from a signal handler that interrupted ``frame``, at once where that is safe,
    else as soon as the main thread is back in code that is (:func:`_unsafe`).

    Python runs a handler between two bytecodes of whatever the main thread was running, and an
    exception raised there lands in that code: in ``threading.Condition.__exit__`` before its
    ``release`` (every ``Event.set`` passes there, a rank's heartbeat beats through one) it leaves
    the lock held, and the stop's own clean-up then blocks on it forever (a rank that never stops,
    found only by the launcher's SIGKILL). Deferred, the exception is raised by a trace function at
    the first line or return event of a frame of the interrupted stack outside that code:
    microseconds later, once the lock is released (never in a function that code calls, such as a
    finalizer the garbage collector runs meanwhile, which would swallow it). The trace function is
    the main thread's only until then, and Python unsets it when it raises: a trace function in
    place before (a debugger, coverage) is not put back, as the process is stopping. A handler may
    be called only in the main thread."""
    if not _unsafe(frame):
        raise exc
    traced: list[tuple[FrameType, Any]] = []

    def tracer(f: FrameType, event: str, arg: object) -> Callable[..., Any] | None:
        if event == "call" and all(f is not g for g, _ in traced):
            return None  # called meanwhile (a finalizer the collector ran): an exception there could be swallowed
        if _unsafe(f):
            return tracer
        for g, trace in traced:
            g.f_trace = trace
        raise exc  # Python unsets the thread's trace function (this one) as it propagates

    f = frame
    while f is not None:  # every frame on the stack: the events of the frames it returns into
        traced.append((f, f.f_trace))
        f.f_trace = tracer
        f = f.f_back
    sys.settrace(tracer)


def interrupt_when_safe(signum: int, frame: FrameType | None) -> None:
    """A SIGINT handler like Python's own (``KeyboardInterrupt``), raised where it is safe
    (:func:`raise_when_safe`): for a process whose stop must not hang on a lock it interrupted."""
    raise_when_safe(frame, KeyboardInterrupt())


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    """Raise :class:`Terminated` once (where it is safe: :func:`raise_when_safe`): a repeated SIGTERM
    (``kill`` typed twice, a supervisor's second try) is ignored, so the cleanup the first one
    started (a swap folder removed) runs to its end; :func:`sigterm_raises` restores the previous
    handler afterwards."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise_when_safe(frame, Terminated())


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """While inside: SIGTERM raises :class:`Terminated` in the main thread (once; the previous
    handler is restored afterwards). The commands run their ``main`` so (``run_command``, the
    runner's Hydra app, the doctor). Start-up ends here (:func:`end_start_up`): the handler
    restored afterwards is the default disposition, not the start-up stand-in, so a SIGTERM while
    the main thread then waits in C (the interpreter's shutdown) still ends the process at once."""
    end_start_up()
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
