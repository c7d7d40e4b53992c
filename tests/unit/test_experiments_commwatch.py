"""CommWatch counts functional collectives (DTensor, tensor parallelism) like torch.distributed calls.

One 2-rank gloo world (run once for the module) measures:

* each functional collective (``torch.distributed._functional_collectives``) against its
  ``torch.distributed`` twin moving the same data over the same group: CommWatch must count the
  same bytes under the same kind and link (the twin is counted by the long-standing wrappers);
* forward and backward of one tensor-parallel GPT block (``Topology(1, 2, tp=2)``, torch's TP
  plans through ``zeropp.runtime.tensor_parallel.parallelize``) against the analytic TP formula
  (``tests.tp_helpers.tp_block_bytes``).

Here: the one-process checks of this topic; its other tiers' checks are in
``tests/distributed/test_experiments_commwatch.py``.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from tests.runtime_helpers import TINY
from tests.worlds import run_world

B = 3  # sequences in the block's input


def _broken_rule(op: str, args: tuple, kwargs: dict) -> Any:
    raise KeyError(f"no rule for {op}")


def _world(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from experiments import commwatch
    from experiments.commwatch import CommWatch
    from zeropp.comm import Topology
    from zeropp.models import GPT
    from zeropp.runtime.tensor_parallel import make_mesh, parallelize

    def done(x: Any) -> Any:
        return [done(y) for y in x] if isinstance(x, list) else (x.wait() if hasattr(x, "wait") else x)

    sub = dist.new_group([0, 1])  # not the default group: the mode resolves it from its name
    g = torch.Generator().manual_seed(rank)
    a = torch.randn(6, 5, generator=g)
    splits_in = [[1, 2], [3, 1]][rank]  # rows this rank sends to rank 0, 1
    splits_out = [[1, 3], [2, 1]][rank]  # rows it receives from rank 0, 1
    rows = sum(splits_in)
    pairs = {
        "all_reduce": (lambda: funcol.all_reduce(a, "sum", sub), lambda: dist.all_reduce(a.clone(), group=sub)),
        "all_gather": (lambda: funcol.all_gather_single(a, 0, sub),
                       lambda: dist.all_gather_single(torch.empty(12, 5), a, group=sub)),
        "reduce_scatter": (lambda: funcol.reduce_scatter_single(a, "sum", 0, sub),
                           lambda: dist.reduce_scatter_single(torch.empty(3, 5), a, group=sub)),
        "all_to_all": (lambda: funcol.all_to_all_single(a[:rows], splits_out, splits_in, sub),
                       lambda: dist.all_to_all_single(torch.empty(sum(splits_out), 5), a[:rows].clone(), splits_out,
                                                      splits_in, group=sub)),
        "broadcast": (lambda: funcol.broadcast(a, 1, sub), lambda: dist.broadcast(a.clone(), 1, group=sub)),
        "all_reduce_coalesced": (lambda: funcol.all_reduce_coalesced([a, a[:2, :3]], "sum", sub),
                                 lambda: [dist.all_reduce(t.clone(), group=sub) for t in (a, a[:2, :3])]),
    }
    out: dict[str, Any] = {"pairs": {}}
    with CommWatch(Topology(2, 1), functional=True) as w:  # ranks 0 and 1 on two nodes: cross
        for name, (functional, plain) in pairs.items():
            w.take()
            done(functional())
            got = w.take()[0]
            plain()
            out["pairs"][name] = (got, w.take()[0])
    with CommWatch(Topology(2, 1)) as w:  # tp == 1: the dispatch mode is off by default
        done(funcol.all_reduce(a, "sum", sub))
        out["off"] = (w.functional, w.take()[0])
    with CommWatch(Topology(2, 1), functional=True) as w, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rule = commwatch._functional_rule
        commwatch._functional_rule = _broken_rule  # a collective the mode cannot read: counted as nothing, named once
        try:
            results = [done(funcol.all_reduce(a, "sum", sub)) for _ in range(2)]
        finally:
            commwatch._functional_rule = rule
        counted = w.take()[0]
    want = a.clone()
    dist.all_reduce(want, group=sub)
    out["uncounted"] = (counted, dict(w.uncounted), [str(c.message) for c in caught],
                        all(torch.equal(x, want) for x in results))

    topo = Topology(1, 2, tp=2)
    torch.manual_seed(0)
    block = parallelize(GPT(TINY), make_mesh(topo)).blocks[0]
    x = torch.randn(B, TINY.seq_len, TINY.d_model, requires_grad=True)
    with CommWatch(topo) as w:
        out["tp_functional"] = w.functional
        w.take()
        y = block(x)
        out["forward"] = w.take()[0]
        y.sum().backward()
        out["backward"] = w.take()[0]
    return out


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return run_world(_world, 2)


def test_a_torch_distributed_call_it_cannot_count_runs_and_is_named_once() -> None:
    """No process group here, so the group's ranks cannot be read: the wrapped call still runs."""
    from experiments.commwatch import CommWatch
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


