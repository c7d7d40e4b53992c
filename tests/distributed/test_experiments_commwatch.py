"""CommWatch counts functional collectives (DTensor, tensor parallelism) like torch.distributed calls.

One 2-rank gloo world (run once for the module) measures:

* each functional collective (``torch.distributed._functional_collectives``) against its
  ``torch.distributed`` twin moving the same data over the same group: CommWatch must count the
  same bytes under the same kind and link (the twin is counted by the long-standing wrappers);
* forward and backward of one tensor-parallel GPT block (``Topology(1, 2, tp=2)``, torch's TP
  plans through ``zeropp.runtime.tensor_parallel.parallelize``) against the analytic TP formula
  (``tests.tp_helpers.tp_block_bytes``).

Here: the gloo-world checks of this topic; its other tiers' checks are in
``tests/unit/test_experiments_commwatch.py``.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from tests.runtime_helpers import TINY
from tests.tp_helpers import tp_block_bytes
from tests.worlds import run_world

B = 3  # sequences in the block's input


def _broken_rule(op: str, args: tuple, kwargs: dict) -> Any:
    raise KeyError(f"no rule for {op}")


def _world(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from experiments.runner import commwatch
    from experiments.runner.commwatch import CommWatch
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
        "all_gather": (
            lambda: funcol.all_gather_single(a, 0, sub),
            lambda: dist.all_gather_single(torch.empty(12, 5), a, group=sub),
        ),
        "reduce_scatter": (
            lambda: funcol.reduce_scatter_single(a, "sum", 0, sub),
            lambda: dist.reduce_scatter_single(torch.empty(3, 5), a, group=sub),
        ),
        "all_to_all": (
            lambda: funcol.all_to_all_single(a[:rows], splits_out, splits_in, sub),
            lambda: dist.all_to_all_single(
                torch.empty(sum(splits_out), 5), a[:rows].clone(), splits_out, splits_in, group=sub
            ),
        ),
        "broadcast": (lambda: funcol.broadcast(a, 1, sub), lambda: dist.broadcast(a.clone(), 1, group=sub)),
        "all_reduce_coalesced": (
            lambda: funcol.all_reduce_coalesced([a, a[:2, :3]], "sum", sub),
            lambda: [dist.all_reduce(t.clone(), group=sub) for t in (a, a[:2, :3])],
        ),
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
        rule = commwatch.functional_rule
        commwatch.functional_rule = _broken_rule  # a collective the mode cannot read: counted as nothing, named once
        try:
            results = [done(funcol.all_reduce(a, "sum", sub)) for _ in range(2)]
        finally:
            commwatch.functional_rule = rule
        counted = w.take()[0]
    want = a.clone()
    dist.all_reduce(want, group=sub)
    out["uncounted"] = (
        counted,
        dict(w.uncounted),
        [str(c.message) for c in caught],
        all(torch.equal(x, want) for x in results),
    )

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


@pytest.mark.parametrize(
    "name", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "all_reduce_coalesced"]
)
def test_functional_collective_counts_what_its_torch_distributed_twin_counts(world, name: str) -> None:
    for rank, r in enumerate(world):
        functional, plain = r["pairs"][name]
        assert functional == plain, (rank, name, functional, plain)
    sent = [sum(r["pairs"][name][0].values()) for r in world]
    assert all(k.endswith(".cross") for r in world for k in r["pairs"][name][0])
    if name == "broadcast":
        assert sent == [0, 6 * 5 * 4]  # only the root (group rank 1) sends
    elif name == "all_to_all":
        assert sent == [2 * 5 * 4, 3 * 5 * 4]  # the uneven split each rank sends its peer
    else:
        assert min(sent) > 0


def test_functional_collectives_are_counted_only_with_the_mode(world) -> None:
    for r in world:
        assert r["off"] == (False, {})  # tp == 1 and not asked for: off, nothing counted
        assert r["tp_functional"] is True  # tp > 1: on


def test_a_functional_collective_it_cannot_count_runs_and_is_named_once(world) -> None:
    for r in world:
        counted, uncounted, messages, same = r["uncounted"]
        assert counted == {} and same, r["uncounted"]  # nothing counted; both all-reduces gave the right sum
        assert uncounted == {"all_reduce": "KeyError: 'no rule for all_reduce'"}
        assert [m for m in messages if "CommWatch could not count" in m] == [
            "CommWatch could not count all_reduce (KeyError: 'no rule for all_reduce'): the collective runs, but "
            "this run's comm_bytes figures miss its bytes"
        ]


def test_tp_block_bytes_match_the_tensor_parallel_formula(world) -> None:
    want = tp_block_bytes(B, TINY.seq_len, TINY.d_model, tp=2)
    assert want == {"forward": 2 * B * 16 * 32 * 4, "backward": 2 * B * 16 * 32 * 4}
    for r in world:
        assert r["forward"] == {"all_reduce.intra": want["forward"]}, r["forward"]
        assert r["backward"] == {"all_reduce.intra": want["backward"]}, r["backward"]


def _transports(rank: int, world: int) -> dict[str, Any]:
    """Per (stage, transport): what CommWatch counted over two training steps of the same engine,
    bytes by kind and link and the time blocked, and what the engine counted itself."""
    from experiments.runner.commwatch import CommWatch
    from tests.runtime_helpers import make_model, rank_batches
    from zeropp.comm import Topology
    from zeropp.runtime import ZeroConfig, ZeroEngine

    topo = Topology(nodes=1, ranks_per_node=world)
    out: dict[str, Any] = {}
    for stage in (0, 3):
        for transport in ("shm", "backend"):
            zc = ZeroConfig(stage=stage, transport=transport)  # type: ignore[arg-type]
            eng = ZeroEngine(make_model(), config=zc, topology=topo)
            try:
                with CommWatch(topo, sessions=[eng.comm_session]) as w:
                    w.take()
                    for s in range(2):
                        eng.train_step(rank_batches(s, zc.grad_accum_steps, rank, TINY, False))
                    counted, wait = w.take()
                out[f"{stage}/{transport}"] = {
                    "bytes": counted,
                    "wait": wait,
                    "engine": eng.comm_stats.snapshot(),
                    "resolved": eng.transport.resolved,
                }
            finally:
                eng.close()
    return out


def test_shared_memory_collectives_are_counted_as_the_backends():
    """The engine's collectives through shared memory never reach ``torch.distributed``; CommWatch
    (``comm_bytes_per_step``, ``comm_wait_s_per_step`` of every run) counts them through the
    session's send and wait hooks, so a run reads the same bytes by kind and link whichever
    transport carried them, and its time blocked is not lost."""
    for r in run_world(_transports, 2):
        for stage in (0, 3):
            shm, backend = r[f"{stage}/shm"], r[f"{stage}/backend"]
            assert (shm["resolved"], backend["resolved"]) == ("shm", "backend")
            assert shm["engine"] == backend["engine"]
            assert shm["bytes"] == backend["bytes"], (stage, shm["bytes"], backend["bytes"])
            moved = sum(v for k, v in shm["bytes"].items() if k.endswith(".intra"))
            assert moved >= sum(sum(links.values()) for links in shm["engine"].values()) > 0
            assert shm["wait"] > 0
