"""Overlap in the engine: the stream/event ordering of ``CommStreams`` and the schedule of prefetched
gathers and early reduce-scatters.

Here: the one-process checks. The topic's full description and its gloo-world checks are in
``tests/distributed/test_runtime_overlap.py``.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.fake_streams import FAKE_ELAPSED_S, FakeAPI
from zeropp.runtime.streams import CommStreams


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
