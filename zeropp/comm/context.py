"""The process's communication state, owned by one object with a lifetime: the comm worker
thread (CPU continuations, ``chain.py``), the CUDA side streams of the default session's
continuations, and the CPU buffers handed to the backend that its threads may still hold.
What belongs to one engine or plug-in (topology and groups, byte counts, the stochastic-rounding
counter, its own side streams, wait hooks) is its ``session.CommSession``, not this.

Why a lifetime matters: a process must end with no thread of ours, or of the backend's, about to
touch Python objects, because once the interpreter is finalizing, CPython makes any thread that
asks for the GIL exit on the spot, and a thread that exits that way inside a C++ destructor ends
the process with ``terminate called without an active exception`` (SIGABRT), after a run that
printed correct results. Two threads can do that:

- the comm worker, while a continuation waits on gloo or runs Python;
- a gloo worker thread (``ProcessGroupGloo::runLoop``): it drops its references to a finished
  collective's tensors a moment *after* waking the waiter. Since torch 2.10 a tensor's C++
  object owns its Python object while other C++ references exist, and the release that brings
  the count back to one hands the Python object back, taking the GIL (and freeing it, if the
  caller has dropped it: the quantized collectives' wire buffers, a ``.view(-1)`` of the output).
  Right before interpreter exit, that aborts. Torch joins gloo's threads only when a process
  group object is destroyed, which the user's own references can postpone past interpreter
  exit, ``destroy_process_group()`` or not.

So :class:`CommContext`:

- runs continuations on one worker thread (FIFO; see ``chain.py`` for the ordering contract),
  started at first use and restarted after :meth:`~CommContext.close`;
- holds every CPU tensor it hands to the backend (:meth:`~CommContext.issue`) with a Python
  reference and a C++ one of its own (a DLPack capsule) until the backend has released it, so
  the backend's release is never the one that reaches the GIL; the context's own release runs
  on a Python thread. The backend has released a tensor when its C++ use count is back to what
  it was before the call (torch has no API that waits for gloo's worker threads, hence the
  count). Held tensors are checked and dropped at the next call and by :meth:`~CommContext.close`;
- :meth:`~CommContext.close` drains and joins the worker, then waits until the backend released
  every held tensor. It runs when the default process group the worker started under is
  destroyed, and at interpreter exit from an ``atexit`` hook, which Python runs before it starts
  finalizing (and after torch's own hooks were registered, so before them). Each wait is bounded
  (:data:`CLOSE_TIMEOUT_S`); what is left then is named in one warning, never waited on forever.

One context per process (:func:`current`); a forked child gets a fresh one.

Debug mode (:data:`DEBUG_ENV` ``=1``, read once per process, when its context is created at
the first communication call, so it reaches every rank through its environment, also one set
by the launcher after the rank imported zeropp): the context's ``debug_streams`` is on, which
``lifetime.py`` reads to poison released buffers, and the comm worker runs each continuation
*late*: only after the caller has moved on (its next submission, a ``Deferred.wait()``, or
:meth:`~CommContext.close`), or after :attr:`~CommContext.late_s` at most, so no peer waits
forever for a continuation nobody prompts. A buffer the caller released at issue is then
already poisoned when the continuation reads it (``lifetime.py`` says why that matters).

Collectives debug mode (:data:`DEBUG_COLLECTIVES_ENV` ``=1``, read the same way, once per
process when its context is created): the context's ``debug_collectives`` is on, the default of
every ``session.CommSession``'s ``check_collectives``, so each public collective first checks
that every rank of its group made the same call (``callcheck.py``).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import queue
import threading
import time
import warnings
import weakref
from typing import Callable, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist
import torch.utils.dlpack

__all__ = [
    "CLOSE_TIMEOUT_S",
    "DEBUG_COLLECTIVES_ENV",
    "DEBUG_ENV",
    "DEBUG_LATE_S",
    "CommContext",
    "abort_process_groups",
    "close_process_groups",
    "current",
    "debug_collectives_from_env",
    "debug_streams_from_env",
]

CLOSE_TIMEOUT_S = 30.0
"""How long :meth:`CommContext.close` waits for queued continuations and for the backend to
release held buffers before it warns and returns (a continuation can only take longer when a
collective is stuck waiting for a peer)."""

DEBUG_ENV = "ZEROPP_DEBUG_STREAMS"
"""Environment variable of the streams debug mode: ``1`` on, ``0`` or unset off."""

DEBUG_COLLECTIVES_ENV = "ZEROPP_DEBUG_COLLECTIVES"
"""Environment variable of the collectives debug mode (``callcheck.py``): ``1`` on, ``0`` or unset off."""

DEBUG_LATE_S = 0.2
"""Debug mode: the longest a continuation waits for the caller to move on before it runs anyway."""


def _flag_from_env(name: str, does: str, environ: Optional[dict]) -> bool:
    """Parse the on/off variable ``name``; any value but ``1``, ``0`` or empty is refused, so a
    typo cannot silently leave a debug mode off."""
    raw = (os.environ if environ is None else environ).get(name, "")
    value = raw.strip()
    if value in ("", "0"):
        return False
    if value == "1":
        return True
    raise ValueError(
        f"{name}={raw!r} is not a valid setting; set {name}=1 to {does} (debug mode), or 0 / unset it for normal runs"
    )


def debug_streams_from_env(environ: Optional[dict] = None) -> bool:
    """Parse :data:`DEBUG_ENV` (``os.environ`` by default); any value but ``1``, ``0`` or empty
    is refused, so a typo cannot silently leave the mode off."""
    return _flag_from_env(DEBUG_ENV, "poison released communication buffers and run continuations late", environ)


def debug_collectives_from_env(environ: Optional[dict] = None) -> bool:
    """Parse :data:`DEBUG_COLLECTIVES_ENV` (``os.environ`` by default), as :func:`debug_streams_from_env`."""
    return _flag_from_env(
        DEBUG_COLLECTIVES_ENV, "check that every rank of a group makes the same collective call", environ
    )


_POLL_S = 0.001
_THREAD = threading.local()  # .context: the CommContext whose worker this thread is
T = TypeVar("T")


def _use_count(t: torch.Tensor) -> int:
    """References to ``t``'s C++ tensor (the Python object's one, views', the backend's)."""
    return torch.Tensor._use_count(t)


def _pin(t: torch.Tensor) -> Optional[object]:
    """A C++ reference of ours to ``t`` (a DLPack capsule; None for what DLPack cannot export).
    Why: torch >= 2.10 lets a tensor's C++ object own its Python object while it has other C++
    references, and the thread whose release brings the count back to one hands the Python
    object back, which takes the GIL. With this pin the backend's release never is that one."""
    try:
        return torch.utils.dlpack.to_dlpack(t)
    except (RuntimeError, TypeError, BufferError):
        return None


class CommContext:
    """The comm worker, the CUDA side streams and the backend's held buffers of one process."""

    def __init__(self, debug_streams: Optional[bool] = None, debug_collectives: Optional[bool] = None) -> None:
        self._lock = threading.RLock()  # a finalizer may close() while this thread holds it
        self._pid = os.getpid()
        self.debug_streams = debug_streams_from_env() if debug_streams is None else bool(debug_streams)
        """Streams debug mode (``lifetime.py``): poison released buffers, run continuations late
        (None at construction: :data:`DEBUG_ENV` decides)."""
        self.debug_collectives = debug_collectives_from_env() if debug_collectives is None else bool(debug_collectives)
        """Collectives debug mode (``callcheck.py``): the default of every session's
        ``check_collectives`` (None at construction: :data:`DEBUG_COLLECTIVES_ENV` decides)."""
        self.late_s = DEBUG_LATE_S
        """Debug mode: the longest a continuation waits for the caller to move on (seconds)."""
        self._moved_on = threading.Condition(threading.Lock())
        self._caller_events = 0  # submissions, waits and closes so far (debug mode's late start)
        self._queue: Optional[queue.SimpleQueue[Optional[tuple[Callable[[], None], int]]]] = None
        self._thread: Optional[threading.Thread] = None
        self._on_destroy: Optional[weakref.finalize] = None
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._held: list[tuple[torch.Tensor, int, Optional[object]]] = []  # tensor, count before, pin
        self._kept: list[tuple[torch.Tensor, int, Optional[object]]] = []  # held for good (keep_held)

    # -------------------------------------------------------------- the comm worker
    def submit(self, job: Callable[[], None]) -> None:
        """Queue ``job`` on the worker thread (started now if it is not running). ``job`` must
        not raise (``chain.Deferred.run`` keeps its exception for ``wait()``). In debug mode it
        runs only after the caller's next event (:meth:`moved_on`) or :attr:`late_s`."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._start()
            assert self._queue is not None
            self._queue.put((job, self.moved_on()))

    def moved_on(self) -> int:
        """The caller's thread went past a submission or a wait: continuations queued before
        may start (debug mode). Returns the event's number."""
        with self._moved_on:
            self._caller_events += 1
            self._moved_on.notify_all()
            return self._caller_events

    def _wait_until_moved_on(self, since: int) -> None:
        """Debug mode: wait (at most :attr:`late_s`) for a caller event after event ``since``."""
        with self._moved_on:
            self._moved_on.wait_for(lambda: self._caller_events > since, self.late_s)

    def in_worker(self) -> bool:
        """True on this context's worker thread (also one that is finishing its queue after
        :meth:`close`, whose continuations must still run their nested ones inline)."""
        return getattr(_THREAD, "context", None) is self

    @property
    def pid(self) -> int:
        """The process this context belongs to (a forked child's copy is not its own)."""
        return self._pid

    @property
    def worker_alive(self) -> bool:
        """Whether the worker thread is running (it starts at the first continuation)."""
        t = self._thread
        return t is not None and t.is_alive()

    def _start(self) -> None:
        q: queue.SimpleQueue[Optional[tuple[Callable[[], None], int]]] = queue.SimpleQueue()
        self._queue = q
        self._thread = threading.Thread(target=self._loop, args=(q,), name="zeropp-comm", daemon=True)
        self._thread.start()
        if self._on_destroy is not None:
            self._on_destroy.detach()
            self._on_destroy = None
        if dist.is_available() and dist.is_initialized():
            # the continuations use this default group's groups: when torch destroys it, stop
            self._on_destroy = weakref.finalize(dist.group.WORLD, self._stop_worker, CLOSE_TIMEOUT_S)
            self._on_destroy.atexit = False  # interpreter exit is _close_at_exit's job

    def _loop(self, q: queue.SimpleQueue[Optional[tuple[Callable[[], None], int]]]) -> None:
        _THREAD.context = self
        while True:
            item = q.get()
            if item is None:  # close(): everything queued before has run
                return
            job, since = item
            if self.debug_streams:
                self._wait_until_moved_on(since)
            job()

    def abandon_worker(self) -> None:
        """Stop waiting for the worker: after the process groups were aborted a continuation may
        wait on aborted work for good. The worker (a daemon thread) is told to end after its
        current job, if that ever returns, and is otherwise left to end with the process;
        :meth:`close` no longer joins it and the next continuation starts a new worker."""
        with self._lock:
            q = self._queue
            self._thread = self._queue = None
            if self._on_destroy is not None:
                self._on_destroy.detach()
                self._on_destroy = None
        if q is not None:
            q.put(None)

    def _stop_worker(self, timeout: float) -> bool:
        """Let the worker finish what is queued, then join it (for at most ``timeout`` s)."""
        with self._lock:
            thread, q = self._thread, self._queue
            self._thread = self._queue = None
            if self._on_destroy is not None:
                self._on_destroy.detach()
                self._on_destroy = None
        if thread is None or q is None:
            return True
        self.moved_on()  # debug mode: queued continuations need not wait for the caller any more
        q.put(None)
        if thread is threading.current_thread():
            return True  # closed from a continuation: it ends after this job
        thread.join(timeout)
        if thread.is_alive():
            warnings.warn(
                f"zeropp.comm: the comm worker did not finish its queued continuations within {timeout:.0f} s "
                "(a collective still waiting for its peers?); it is left running and the process may abort "
                "at exit. Wait every async handle before destroying the process group or exiting.",
                RuntimeWarning,
                stacklevel=3,
            )
            return False
        return True

    # -------------------------------------------------------------- CUDA side streams
    def side_stream(self, device: torch.device) -> torch.cuda.Stream:
        """This context's side stream of a CUDA ``device`` (created at first use)."""
        with self._lock:
            s = self._streams.get(device)
            if s is None:
                s = self._streams[device] = torch.cuda.Stream(device)
            return s

    # -------------------------------------------------------------- buffers the backend holds
    def issue(self, call: Callable[[], T], tensors: Sequence[torch.Tensor]) -> T:
        """Run ``call`` (a backend collective on ``tensors``) and keep the CPU ones, with a C++
        reference of ours, until the backend has released them (see the module docstring)."""
        cpu = [t for t in tensors if t.device.type == "cpu"]
        pins = [_pin(t) for t in cpu]
        counts = [_use_count(t) for t in cpu]
        result = call()
        with self._lock:
            self._prune()
            self._held.extend(zip(cpu, counts, pins))
        return result

    @property
    def held(self) -> int:
        """How many tensors handed to the backend it may still hold (after a prune)."""
        with self._lock:
            self._prune()
            return len(self._held)

    def _prune(self) -> None:
        """Drop (on this thread, which holds the GIL) what the backend no longer references."""
        self._held = [h for h in self._held if _use_count(h[0]) > h[1]]

    def keep_held(self) -> int:
        """Stop waiting for the backend to release what it holds: those tensors stay referenced for
        the rest of the process (as after :meth:`close`'s timeout, without its warning). For after
        the process groups were aborted, whose issued work never completes, so the backend may
        never release its buffers and :meth:`close` would wait its whole timeout. Returns how
        many tensors are kept."""
        with self._lock:
            self._prune()
            kept = len(self._held)
            self._kept.extend(self._held)
            self._held = []
        return kept

    def _release_held(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                self._prune()
                left = len(self._held)
            if not left:
                return True
            if time.monotonic() >= deadline:
                break
            time.sleep(_POLL_S)  # the backend's threads drop them microseconds after the wait
        warnings.warn(
            f"zeropp.comm: {left} tensor(s) handed to the backend are still referenced after {timeout:.0f} s "
            "(an async handle never waited, or a view of a collective's buffer kept alive); they stay "
            "referenced by this process.",
            RuntimeWarning,
            stacklevel=3,
        )
        return False

    # -------------------------------------------------------------- lifetime
    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> bool:
        """Drain and join the comm worker, then wait until the backend released every buffer it
        was handed; each for at most ``timeout`` s (a warning names what was left). Idempotent;
        the context stays usable (the next continuation starts a new worker). True if clean."""
        if os.getpid() != self._pid:
            return True  # a forked child's copy: its worker thread and buffers are the parent's
        ok = self._stop_worker(timeout)
        return self._release_held(timeout) and ok


_CURRENT: Optional[CommContext] = None
_CURRENT_LOCK = threading.Lock()


def current() -> CommContext:
    """This process's communication context (a fresh one in a forked child)."""
    global _CURRENT
    ctx = _CURRENT
    if ctx is not None and ctx.pid == os.getpid():
        return ctx
    with _CURRENT_LOCK:
        if _CURRENT is None or _CURRENT.pid != os.getpid():
            _CURRENT = CommContext()
        return _CURRENT


SETTLE_TIMEOUT_S = 2.0
"""How long interpreter exit waits for the backend's worker threads to go idle (best effort)."""

_BACKEND_THREADS = frozenset({"pt_gloo_runloop"})  # gloo's per-group worker threads, as Linux names them


def _backend_threads_settle(timeout: float = SETTLE_TIMEOUT_S, interval: float = 0.005) -> bool:
    """Wait, at most ``timeout`` s, until every gloo worker thread of this process was asleep on
    two samples in a row, ``interval`` apart, while this thread held no GIL (it sleeps between
    samples). True when they settled (or there are none, or this is not Linux).

    Why: :meth:`CommContext.issue` covers the tensors zeropp hands to the backend, but not those
    torch's own collectives create and drop (``all_gather_object``'s temporaries, DTensor's
    functional collectives in FSDP2's gradient clipping, DCP's planning exchanges). A gloo thread
    that is still about to release one when the interpreter starts finalizing aborts the process
    (the module docstring says why). Those threads outlive ``destroy_process_group()`` while
    something in C++ still references their group (``fully_shard`` does), so they cannot be
    joined from here; torch has no API to wait for them, hence reading each thread's scheduler
    state from ``/proc`` (a thread waiting for the GIL gets it while this one sleeps, then goes
    back to sleeping on its work queue)."""
    task = f"/proc/{os.getpid()}/task"
    deadline = time.monotonic() + timeout
    calm = 0
    while True:
        try:
            tids = os.listdir(task)
        except OSError:
            return True
        states = []
        for tid in tids:
            try:
                with open(f"{task}/{tid}/stat") as f:
                    stat = f.read()
            except OSError:
                continue  # the thread ended
            if stat[stat.index("(") + 1 : stat.rindex(")")] in _BACKEND_THREADS:
                states.append(stat[stat.rindex(")") + 2])
        calm = calm + 1 if all(st == "S" for st in states) else 0
        if calm >= 2 or not states:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def _never_destroyed(obj: object) -> None:
    """Give ``obj`` a reference nothing releases, so its destructor never runs in this process
    (not even while the interpreter finalizes). For aborted gloo groups: their destructor waits in
    C++ for their issued work, which an abort does not end, so it would hold the exit (or the
    caller) until the group's timeout; the process's exit closes their sockets instead."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def abort_process_groups() -> bool:
    """Abort every process group of this process, for a rank that leaves alone (an error of its
    own, a launcher's SIGTERM) while its peers may still be in a collective with it; the process
    should exit soon after. Destroying the groups instead (``destroy_process_group``) would wait,
    in C++, for work this rank issued that its peers never join, until the group's timeout, and
    the peers would stay blocked in gloo meanwhile (where their own SIGTERM handler cannot run).

    After this call torch knows no group (``dist.is_initialized()`` is False; do not destroy
    them); the aborted groups are never destroyed in this process (:func:`_never_destroyed`); the
    comm worker, which may wait on aborted work for good, is left to end with the process
    (:meth:`CommContext.abandon_worker`) and what the backend holds stays referenced
    (:meth:`CommContext.keep_held`). Nothing then holds the exit: the process ends, its sockets
    close, and the peers' calls fail with a "connection closed" error (gloo's abort alone closes
    nothing). NCCL communicators are aborted for real. A later ``init_process_group`` works (a
    new worker starts), but the aborted groups' threads and sockets stay until exit. Returns
    whether it aborted (False: no group, or torch refused, which a warning names)."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    try:  # torch's own abort of every group (no public one for all groups yet)
        for group in list(torch.distributed.distributed_c10d._world.pg_names):
            _never_destroyed(group)
        torch.distributed.distributed_c10d._abort_process_group()
    except Exception as e:
        warnings.warn(f"zeropp.comm: aborting the process groups failed ({type(e).__name__}: {e})", stacklevel=2)
        return False
    ctx = current()
    ctx.abandon_worker()
    ctx.keep_held()
    return True


def close_process_groups(*, aborted: bool) -> None:
    """End this process's process groups: destroy them when the ranks leave together, abort them
    (:func:`abort_process_groups`) when this rank leaves alone (an error, a launcher's SIGTERM), so
    peers blocked in a collective with it fail at once rather than at a SIGKILL. Either way none is
    left to destroy."""
    if aborted:
        abort_process_groups()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _close_at_exit() -> None:
    ctx = _CURRENT
    if ctx is not None:
        ctx.close()
    if dist.is_available():
        _backend_threads_settle()


atexit.register(_close_at_exit)
