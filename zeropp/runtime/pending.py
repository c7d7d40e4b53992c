"""One logical collective of the engine in flight (:class:`Pending`): what waiting for it means.

:class:`~.collectives.EngineComm` returns a :class:`Pending` for every collective it issues, one
or several bucket-sized chunks. Waiting is timed by the engine's :class:`~.streams.CommStreams`
(``streams.py``: compute-stream stalls on CUDA, host time on CPU) and named in the profiler
(``zeropp/<kind>/<unit>/wait``, ``zeropp.comm.ranges``).

Buffer lifetimes (``zeropp.comm.lifetime``): a chunk's contiguous temporary (the input copy of a
plain reduce-scatter chunk, the output of a plain all-gather chunk) belongs to the
:class:`Pending` and is released by :meth:`Pending.complete`, after the chunk's handles were
waited and its copy-out ran, on the stream that completed it (the side stream with streams).
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol

from zeropp.comm import ranges
from zeropp.comm.lifetime import Buffers

from .streams import CommStreams


class StreamsOwner(Protocol):
    """What a :class:`Pending` waits through: its owner's streams, read at wait time (a test or a
    caller may swap an engine's ``streams``)."""

    streams: CommStreams


class Pending:
    """One logical collective (possibly several chunks): wait for it before using its output.

    Without streams: the backend handles plus what to do after them (chunk copies, a divide),
    run in :meth:`wait`. With streams (CUDA): everything was enqueued on a side stream at issue
    and ``event`` marks its end; :meth:`wait` makes the compute stream wait for it.
    """

    def __init__(
        self,
        owner: StreamsOwner,
        works: list,
        finish: Optional[Callable[[], object]] = None,
        *,
        event: object = None,
        buffers: Optional[Buffers] = None,
        what: tuple[str, str] = ("", ""),
    ) -> None:
        self._owner, self._works, self._finish, self._event, self.done = owner, works, finish, event, False
        self._buffers = buffers  # the chunks' temporaries, released by complete()
        self.what = what
        """``(kind, unit)`` of the collective: its wait's profiler range (module doc)."""

    @classmethod
    def finished(cls, owner: StreamsOwner, what: tuple[str, str]) -> Pending:
        """A collective whose result was written at issue (a group of one): its wait returns at once."""
        done = cls(owner, [], None, what=what)
        done.done = True
        return done

    def wait(self) -> None:
        if self.done:
            return
        kind, unit = self.what
        with ranges.span(ranges.wait_name(kind, unit) if kind and ranges.enabled() else None):
            if self._event is not None:
                self._owner.streams.wait(self._event)  # timed inside
            else:
                with self._owner.streams.blocked():
                    self.complete()
        self.done = True

    def complete(self) -> None:
        """Wait for the backend handles and run the post-processing, untimed (callers time it)."""
        for w in self._works:
            if w is not None:
                w.wait()
        if self._finish is not None:
            self._finish()
        self._works, self._finish = [], None
        buffers, self._buffers = self._buffers, None
        if buffers is not None:
            buffers.release()
