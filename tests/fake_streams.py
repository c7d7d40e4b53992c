"""A recording fake of the CUDA stream API that ``CommStreams`` calls, so that the engine's
stream/event ordering can be checked on CPU: every operation lands as a tuple in ``FakeAPI.log``
and timed waits each last ``FAKE_ELAPSED_S``."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

FAKE_ELAPSED_S = 0.001


class FakeStream:
    """A stream known by its name in the log."""

    def __init__(self, name: str) -> None:
        self.name = name


class FakeEvent:
    """An event: its number in the log, whether it times, and the stream it was recorded on."""

    def __init__(self, k: int, timing: bool) -> None:
        self.k, self.timing, self.stream = k, timing, None


class FakeAPI:
    """Records every stream operation as a tuple in ``log``; the current stream is a stack."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.compute = FakeStream("compute")
        self._stack = [self.compute]
        self._n = 0

    def current_stream(self) -> FakeStream:
        return self._stack[-1]

    def new_stream(self) -> FakeStream:
        self._n += 1
        return FakeStream(f"side{self._n}")

    def new_event(self, timing: bool) -> FakeEvent:
        self._n += 1
        return FakeEvent(self._n, timing)

    @contextlib.contextmanager
    def use_stream(self, stream: FakeStream) -> Iterator[None]:
        self.log.append(("use", stream.name))
        self._stack.append(stream)
        try:
            yield
        finally:
            self._stack.pop()
            self.log.append(("end", stream.name))

    def wait_stream(self, waiter: FakeStream, waited: FakeStream) -> None:
        self.log.append(("wait_stream", waiter.name, waited.name))

    def wait_event(self, stream: FakeStream, event: FakeEvent) -> None:
        assert event.stream is not None, "waited on an event that was never recorded"
        self.log.append(("wait_event", stream.name, event.k))

    def record_event(self, event: FakeEvent, stream: FakeStream) -> None:
        event.stream = stream.name
        self.log.append(("record", event.k, stream.name, event.timing))

    def record_stream(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        self.log.append(("record_stream", stream.name, id(tensor)))

    def elapsed_s(self, start: FakeEvent, end: FakeEvent) -> float:
        assert start.timing and end.timing and start.stream == end.stream == "compute"
        return FAKE_ELAPSED_S
