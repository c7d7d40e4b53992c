"""Communication that runs without the caller: qgZ's cross-node hop issued before ``wait()``, several
reduce-scatters outstanding at once, and the DDP hook's real future.

Here: the one-process checks. The topic's full description and its gloo-world checks are in
``tests/distributed/test_comm_overlap.py``.
"""

from __future__ import annotations

import threading

import pytest
import torch

from zeropp.comm import chain

CPU = torch.device("cpu")


# ------------------------------------------------------------------ chain (one process)
def test_chain_runs_in_submission_order_off_the_caller_thread() -> None:
    gate, order, threads = threading.Event(), [], []
    first = chain.submit(lambda: (gate.wait(10), order.append(0)), CPU)
    rest = [
        chain.submit(lambda k=k: (order.append(k), threads.append(threading.current_thread())), CPU)
        for k in range(1, 6)
    ]
    assert not first.done() and order == []  # the caller was not blocked by the gated job
    gate.set()
    for d in reversed(rest):  # waiting out of order is fine
        d.wait()
    first.wait()
    assert order == [0, 1, 2, 3, 4, 5]
    assert all(t is not threading.current_thread() for t in threads)


def test_chain_reraises_in_wait_and_keeps_running() -> None:
    def boom() -> None:
        raise ValueError("hop failed")

    bad = chain.submit(boom, CPU)
    ok = chain.submit(lambda: None, CPU)
    with pytest.raises(ValueError, match="hop failed"):
        bad.wait()
    ok.wait()
    assert ok.done()


def test_chain_nested_submit_runs_inline_on_the_worker() -> None:
    seen = []

    def outer() -> None:
        inner = chain.submit(lambda: seen.append(chain.in_worker()), CPU)
        inner.wait()  # would deadlock if queued behind outer
        seen.append("outer")

    chain.submit(outer, CPU).wait()
    assert seen == [True, "outer"] and not chain.in_worker()


def test_submit_future_delivers_result_and_error() -> None:
    t = torch.arange(3.0)
    assert chain.submit_future(lambda: t.mul_(2), t).wait() is t and t.tolist() == [0.0, 2.0, 4.0]
    fut = chain.submit_future(lambda: 1 / 0, t)
    with pytest.raises(ZeroDivisionError):
        fut.wait()
