"""Work that follows a collective (a later hop, a dequantize) run without the caller waiting.

A multi-hop collective (qgZ's cross-node all-to-all after the intra-node one; the DDP hook's
all-gather after its reduce-scatter) must start its next hop as soon as the previous one has
landed, not when the caller finally calls ``wait()``. :func:`submit` runs such a continuation:

- **CUDA**: now, on the side stream of the device of the caller's communication session
  (``session.CommSession.side_stream``; the process context's for the default session), which
  first waits for the caller's current stream. NCCL's ``Work.wait()`` only orders streams, so nothing blocks the
  host: the continuation's kernels and collectives are enqueued at once and run when their
  inputs are ready. The caller's ``wait()``, on whatever stream it is called, makes that
  stream wait on an event recorded at the end.
- **CPU (gloo)**: on the comm worker thread of the process's :class:`~.context.CommContext`, in
  submission order (FIFO). Gloo's ``wait()`` blocks that thread, not the caller. The caller's
  ``wait()`` blocks until the job ran and re-raises what it raised. The context owns the thread:
  it is drained and joined when the default process group is destroyed and at interpreter exit
  (``context.py``), and started again by the next continuation.

Ordering contract: continuations run in the order they were submitted (CPU: one FIFO thread;
CUDA: submitted inline, in order), so the collectives they issue go out in the same order on
every rank as long as the ranks submit in the same order, as SPMD programs do. A process group
used inside continuations (qgZ: the topology's cross-node group) must not be used by the
caller's thread while continuations are outstanding. A continuation that submits another one
(the DDP hook's all-reduce, which runs whole on the worker, calling a synchronous qgZ) runs it
inline.

Buffers (``lifetime.py``): a continuation usually reads buffers the caller allocated on *its*
stream (qgZ: hop 1's send and receive rows). The caller's references are gone when it returns,
and the collective that used them keeps them only until its ``wait()``, which runs inside the
continuation. So :func:`submit` takes them (``buffers=``) and releases them right after the
continuation, on its side stream (CUDA: ``record_stream`` there, so the caching allocator hands
them to the caller's stream only after the side stream has passed the continuation, whatever
stream the caller later waits on) or on the comm worker (CPU). The continuation itself (and the
caller's tensors it references) stays alive until the caller's ``wait()``.

Debug mode (``ZEROPP_DEBUG_STREAMS=1``): continuations run late, the worker waiting for the
caller to move on (``context.py``) and, on CUDA, the side stream first spinning for
:data:`DEBUG_SPIN_CYCLES`, so a buffer released before its continuation used it is read poisoned.
"""

from __future__ import annotations

import datetime
import threading
from typing import TYPE_CHECKING, Callable, Optional

import torch

from . import context, lifetime
from .lifetime import Buffers

if TYPE_CHECKING:
    from .session import CommSession

__all__ = ["DEBUG_SPIN_CYCLES", "Deferred", "in_worker", "submit", "submit_future"]

DEBUG_SPIN_CYCLES = 5_000_000
"""Debug mode, CUDA: GPU clock cycles the side stream spins before each continuation (a few ms)."""


class Deferred:
    """The outcome of one submitted continuation; :meth:`wait` once it is needed."""

    def __init__(self, fn: Callable[[], None], device: torch.device, buffers: Optional[Buffers] = None) -> None:
        self._fn: Optional[Callable[[], None]] = fn
        self._device = device
        self._buffers = buffers  # the caller's buffers the continuation uses, released after it
        self._event: Optional[torch.cuda.Event] = None  # CUDA: end of the continuation on the side stream
        self._done = threading.Event()  # CPU: the worker has run it
        self._error: Optional[BaseException] = None
        self._keep: Optional[Callable[[], None]] = None  # CUDA: the continuation, alive until wait()

    def run(self) -> None:
        """Run the continuation (on the worker or inline), keeping its exception for wait(), then
        release its buffers here: on the side stream (CUDA), on the worker (CPU)."""
        fn, self._fn = self._fn, None
        try:
            if fn is not None:
                fn()
        except BaseException as e:
            self._error = e
        finally:
            buffers, self._buffers = self._buffers, None
            try:
                if buffers is not None:
                    buffers.release()
            finally:
                self._done.set()

    def run_on_stream(self, stream: torch.cuda.Stream) -> None:
        """CUDA: run the continuation now with ``stream`` current (debug mode: after a spin there),
        record the end event there, and keep the continuation (with the caller's tensors it
        references) alive until :meth:`wait`."""
        self._keep = self._fn
        with torch.cuda.stream(stream):
            if lifetime.debug_enabled():
                torch.cuda._sleep(DEBUG_SPIN_CYCLES)  # the side stream lags: early releases get read poisoned
            self.run()
            self._event = torch.cuda.Event()
            self._event.record(stream)

    @property
    def error(self) -> Optional[BaseException]:
        """What the continuation raised (None if it has not run or succeeded)."""
        return self._error

    def done(self) -> bool:
        """True once the continuation has been run (CPU) or enqueued (CUDA)."""
        return self._done.is_set()

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> None:
        """CPU: block until the continuation ran, re-raise its error; with ``timeout`` (a nonzero
        ``timedelta``) a RuntimeError past it, the continuation left running. CUDA: make the current
        stream (any stream) wait for its end (no host wait, so no timeout), then drop the references
        it kept alive; its own buffers were released on the side stream, so no stream reuses them
        early."""
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)
            self._event = None
            self._keep = None
        else:
            context.current().moved_on()  # debug mode: a late continuation may start now
            seconds = None if timeout is None or not timeout.total_seconds() else timeout.total_seconds()
            if not self._done.wait(seconds):
                raise RuntimeError(
                    f"zeropp.comm: the continuation of a collective did not finish within {seconds:.3g} s "
                    "(its messages are still awaited from a peer); wait() again to keep waiting"
                )
            lifetime.completed()
        if self._error is not None:
            err, self._error = self._error, None
            raise err


def in_worker() -> bool:
    """True on the comm worker thread (a continuation submitted there runs inline)."""
    return context.current().in_worker()


def _side_stream(session: Optional[CommSession], device: torch.device) -> torch.cuda.Stream:
    return session.side_stream(device) if session is not None else context.current().side_stream(device)


def submit(
    fn: Callable[[], None],
    device: torch.device,
    buffers: Optional[Buffers] = None,
    *,
    session: Optional[CommSession] = None,
) -> Deferred:
    """Run ``fn`` (which may wait on works and issue collectives) after the caller's current
    work, without blocking the caller; see the module docstring for where it runs. ``buffers``:
    the caller's buffers that ``fn`` (or the work it waits on) still uses; they are released
    right after ``fn`` ran, where it ran. ``session``: whose CUDA side stream it runs on (None:
    the default session's, the process context's)."""
    job = Deferred(fn, device, buffers)
    if device.type == "cuda":
        side = _side_stream(session, device)
        side.wait_stream(torch.cuda.current_stream(device))  # inputs were produced on the caller's stream
        job.run_on_stream(side)
        return job
    ctx = context.current()
    if ctx.in_worker():
        job.run()
        return job
    ctx.submit(job.run)
    return job


def submit_future(
    fn: Callable[[], None], result: torch.Tensor, *, session: Optional[CommSession] = None
) -> torch.futures.Future:
    """Run ``fn`` as :func:`submit` does and return a ``torch.futures.Future`` holding ``result``
    once it finished (the form DDP comm hooks return). On CUDA the future is device-aware: its
    ``wait()`` / ``then()`` make the consumer's stream wait for the side stream (``session``'s)."""
    device = result.device
    if device.type == "cuda":
        job = submit(fn, device, Buffers(borrowed=(result,)), session=session)  # written on the side stream
        fut: torch.futures.Future = torch.futures.Future(devices=[device])
        with torch.cuda.stream(_side_stream(session, device)):
            if job.error is not None:
                fut.set_exception(job.error)
            else:
                fut.set_result(result)  # records its events on the side stream
        return fut
    fut = torch.futures.Future()

    def run_and_complete() -> None:
        try:
            fn()
        except BaseException as e:
            fut.set_exception(e)
            return
        fut.set_result(result)

    submit(run_and_complete, device, session=session)
    return fut
