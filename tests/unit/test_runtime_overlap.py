"""Overlap in the engine: the stream/event ordering of ``CommStreams`` and the schedule of
prefetched gathers and early reduce-scatters.

The CUDA ordering is checked on CPU with a recording fake of the stream API: the engine runs
on gloo ranks with the fake injected, must give bit-identical results to the engine without
streams (the reference), and its log must show every side stream waiting for the compute
stream before it is used, the tensors it reads marked for it, every gathered block bound only
after the compute stream waited for its gather's event, every reduced gradient read only after
its reduce-scatter's event, and ``comm_wait_s`` equal to the sum of the timed waits. The
schedule tests check on the CPU path that stage 3 issues the next block's gather before the
current block computes (forward and backward) and that a block's reduce-scatter is still
outstanding while the backward of the block before it runs.

Here: the one-process checks of this topic; its other tiers' checks are in
``tests/distributed/test_runtime_overlap.py``.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import pytest
import torch

from zeropp.runtime.streams import CommStreams

FAKE_ELAPSED_S = 0.001


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name


class FakeEvent:
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


# ------------------------------------------------------------------ CommStreams alone
def test_cpu_streams_are_noops_and_time_the_host() -> None:
    st = CommStreams(torch.device("cpu"))
    assert not st.enabled and st.streams == {}
    with st.issuing("all_gather", (torch.zeros(2),)):
        pass
    assert st.record("all_gather") is None
    st.wait(None)
    with st.blocked():
        time.sleep(0.02)
    assert st.blocked_s() >= 0.02
    st.reset()
    assert st.blocked_s() == 0.0


def test_fake_streams_order_issue_record_wait() -> None:
    api = FakeAPI()
    st = CommStreams(torch.device("cpu"), api=api)
    rs = st.streams["reduce_scatter"].name
    x = torch.zeros(3)
    with st.blocked():  # issuing on a side stream is not blocked time...
        pass
    with st.issuing("reduce_scatter", (x,)):
        assert api.current_stream().name == rs
        with st.blocked():  # ...and blocked() inside issuing records nothing
            pass
        ev = st.record("reduce_scatter")
    assert api.current_stream() is api.compute
    st.wait(ev)
    assert api.log[2:] == [
        ("wait_stream", rs, "compute"),
        ("record_stream", rs, id(x)),
        ("use", rs),
        ("record", ev.k, rs, False),
        ("end", rs),
        ("record", ev.k + 1, "compute", True),
        ("wait_event", "compute", ev.k),
        ("record", ev.k + 2, "compute", True),
    ]
    assert st.blocked_s() == pytest.approx(2 * FAKE_ELAPSED_S)  # the empty blocked() pair + the wait
    with pytest.raises(ValueError, match="kind must be one of"), st.issuing("broadcast"):
        pass
    with pytest.raises(RuntimeError, match="one at a time"), st.issuing("all_gather"), st.issuing("reduce_scatter"):
        pass
