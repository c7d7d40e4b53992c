"""CommWatch counts functional collectives (DTensor, tensor parallelism) like torch.distributed calls.

Here: the one-process checks. The topic's full description and its gloo-world checks are in
``tests/distributed/test_experiments_commwatch.py``.
"""

from __future__ import annotations

import warnings

import pytest
import torch


def test_a_torch_distributed_call_it_cannot_count_runs_and_is_named_once() -> None:
    """No process group here, so the group's ranks cannot be read: the wrapped call still runs."""
    from experiments.runner.commwatch import CommWatch
    from zeropp.comm import Topology

    w = CommWatch(Topology(1, 1))
    calls: list[tuple] = []
    wrapped = w._wrap("all_reduce", lambda *a, **k: calls.append(a) or "done")
    with pytest.warns(RuntimeWarning, match=r"CommWatch could not count all_reduce \(.*\): the collective runs"):
        assert wrapped(torch.ones(2)) == "done"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per op: the second call is quiet
        assert wrapped(torch.ones(2)) == "done"
    assert len(calls) == 2 and w.take()[0] == {} and list(w.uncounted) == ["all_reduce"]
