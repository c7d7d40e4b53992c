"""The engine's streams and events, owned by one object: :class:`CommStreams`.

On CUDA the engine issues its asynchronous collectives on two side streams, as FSDP2 does (its
``_fsdp_param_group`` / ``_fsdp_collectives``): one for parameter all-gathers, one for gradient
reduce-scatters. The ordering rules, all kept here:

- a side stream first waits for the compute stream (the shard, gradient or buffer it reads was
  produced there), and the tensors it reads are marked as used by it (``record_stream``), so the
  caching allocator does not hand a gradient buffer to new compute work before its
  reduce-scatter has consumed it, even though the engine drops its reference right after issuing;
- the whole collective, post-processing included (dequantize, chunk copies, the divide of a
  plain reduce-scatter), is enqueued on the side stream at issue time, then an event is recorded
  there. NCCL's ``Work.wait()`` only orders streams, so issuing does not block the host;
- before the result is used (a gathered block bound into the module, a reduced gradient added
  to the shard, a prefetched buffer freed) the compute stream waits for that event.

Blocked time (``blocked_s``, the engine's ``comm_wait_s``): on CUDA, the time the *compute
stream* stalled waiting for communication, measured on the GPU by a pair of timing events
recorded on the compute stream around each wait (around the whole call for a synchronous
collective issued on the compute stream, which then also counts its quantization kernels).
Host time spent enqueueing is not counted, as the GPU does not wait for it. On CPU (gloo) there
are no streams: everything above degrades to no-ops and blocked time is host wall time of
waits, synchronous calls and quantization at issue (which runs on the training thread).

The stream operations go through a small :class:`StreamAPI` so the ordering can be checked on
CPU with a recording fake (``tests/{unit,distributed}/test_runtime_overlap.py``).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, ContextManager, Iterator, Protocol, Sequence

import torch

KINDS = ("all_gather", "reduce_scatter")
"""The side streams: parameter all-gathers and gradient reduce-scatters."""


class StreamAPI(Protocol):
    """What :class:`CommStreams` needs of a device's streams and events."""

    def current_stream(self) -> Any: ...
    def new_stream(self) -> Any: ...
    def new_event(self, timing: bool) -> Any: ...
    def use_stream(self, stream: Any) -> ContextManager[Any]: ...
    def wait_stream(self, waiter: Any, waited: Any) -> None: ...
    def wait_event(self, stream: Any, event: Any) -> None: ...
    def record_event(self, event: Any, stream: Any) -> None: ...
    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None: ...
    def elapsed_s(self, start: Any, end: Any) -> float: ...


class CudaStreamAPI:
    """:class:`StreamAPI` over ``torch.cuda`` for one device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device)

    def new_event(self, timing: bool) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=timing)

    def use_stream(self, stream: torch.cuda.Stream) -> ContextManager[Any]:
        return torch.cuda.stream(stream)

    def wait_stream(self, waiter: torch.cuda.Stream, waited: torch.cuda.Stream) -> None:
        waiter.wait_stream(waited)

    def wait_event(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def record_event(self, event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
        event.record(stream)

    def record_stream(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        tensor.record_stream(stream)

    def elapsed_s(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1e3  # ms -> s


class CommStreams:
    """Side streams, events and blocked-time measurement of one engine (see the module docstring).

    ``api=None``: CUDA streams on a CUDA ``device``, none (host timers, no-ops) otherwise. Pass
    an ``api`` to use streams on any device (tests pass a recording fake). ``use_streams=False``
    issues everything on the current stream even on CUDA (the reference the overlap is checked
    against); it cannot be combined with an ``api``.
    """

    def __init__(self, device: torch.device, *, api: StreamAPI | None = None, use_streams: bool = True) -> None:
        if not use_streams and api is not None:
            raise ValueError("CommStreams: use_streams=False with an api; pass api=None to run without streams")
        if api is None and use_streams and device.type == "cuda":
            api = CudaStreamAPI(device)
        self.device = device
        self.api = api
        self.streams: dict[str, Any] = {k: api.new_stream() for k in KINDS} if api is not None else {}
        self._issuing: str | None = None  # the side stream a collective is being issued on
        self._host_s = 0.0  # CPU: accumulated blocked wall time
        self._pairs: list[tuple[Any, Any]] = []  # CUDA: (start, end) timing events on the compute stream

    @property
    def enabled(self) -> bool:
        """True when collectives run on side streams (CUDA, or an injected api)."""
        return self.api is not None

    # ------------------------------------------------------------------ issuing
    @contextlib.contextmanager
    def issuing(self, kind: str, reads: Sequence[torch.Tensor] = ()) -> Iterator[None]:
        """Context in which an asynchronous collective is issued (and post-processed) on the
        ``kind`` side stream, after the compute stream's work so far; ``reads`` are tensors it
        reads that were allocated on the compute stream. No-op without streams."""
        if kind not in KINDS:
            raise ValueError(f"CommStreams.issuing: kind must be one of {KINDS}, got {kind!r}")
        if self.api is None:
            yield
            return
        if self._issuing is not None:
            raise RuntimeError(f"CommStreams.issuing({kind!r}) inside issuing({self._issuing!r}); issue one at a time")
        api, side = self.api, self.streams[kind]
        api.wait_stream(side, api.current_stream())
        for t in reads:
            api.record_stream(t, side)
        self._issuing = kind
        try:
            with api.use_stream(side):
                yield
        finally:
            self._issuing = None

    def record(self, kind: str) -> Any:
        """Record and return an event at the current end of the ``kind`` side stream (call it at
        the end of :meth:`issuing`); None without streams."""
        if self.api is None:
            return None
        ev = self.api.new_event(False)
        self.api.record_event(ev, self.streams[kind])
        return ev

    def wait(self, event: Any) -> None:
        """Make the compute stream wait for ``event`` (from :meth:`record`), timing the stall."""
        if self.api is None or event is None:
            return
        with self.blocked():
            self.api.wait_event(self.api.current_stream(), event)

    # ------------------------------------------------------------------ blocked time
    @contextlib.contextmanager
    def blocked(self) -> Iterator[None]:
        """Count what runs inside as time blocked on communication: host wall time without
        streams; with streams, the compute stream's time between two timing events around it
        (nothing while issuing on a side stream, which blocks no compute)."""
        if self.api is None:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self._host_s += time.perf_counter() - t0
            return
        if self._issuing is not None:
            yield
            return
        api = self.api
        start, end = api.new_event(True), api.new_event(True)
        api.record_event(start, api.current_stream())
        try:
            yield
        finally:
            api.record_event(end, api.current_stream())
            self._pairs.append((start, end))

    def blocked_s(self) -> float:
        """Seconds blocked since :meth:`reset` (with streams: synchronizes on the last event)."""
        if self.api is not None and self._pairs:
            self._host_s += sum(self.api.elapsed_s(a, b) for a, b in self._pairs)
            self._pairs.clear()
        return self._host_s

    def reset(self) -> None:
        self._host_s = 0.0
        self._pairs.clear()

    def __repr__(self) -> str:
        return f"CommStreams(device={self.device}, streams={'on' if self.enabled else 'off'})"
