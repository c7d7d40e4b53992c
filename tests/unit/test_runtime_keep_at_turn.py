"""``ZeroConfig.keep_at_turn``: the root and the last block stay gathered from forward into backward.

* a steady-state step's profiler ranges are the plan's call for call, in issue order: the backward
  gathers of the root and of the last block (a coalesced span too) are gone, every other
  collective is still there;
* at the turn (inside the loss) exactly those two are gathered, every micro-step, at prefetch
  depths 0 and 2; no extra memory: the gather pool allocates the same buffers with and without it;
* only the engine's training forward keeps them: ``eval_loss``, a no-grad forward and a forward the
  user runs outside ``train_step`` (with gradients on) leave every unit free;
* a stage without gathers refuses it (``test_runtime_plan``); fp32 parity with one process is in
  ``tests/distributed/test_runtime_parity.py`` and ``test_runtime_frozen.py``.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.plan_helpers import ZPP, fake_world, profiled_step_ranges
from tests.runtime_helpers import TINY, micro_batch, rank_batches
from zeropp.comm import Topology
from zeropp.models import GPT
from zeropp.runtime import OptimizerConfig, ZeroConfig, ZeroEngine
from zeropp.runtime.gathers import GATHERED
from zeropp.runtime.plan import build_plan
from zeropp.runtime.plan_kinds import CommKind

pytestmark = pytest.mark.usefixtures("one_torch_thread")

THREE = TINY.with_(n_layers=3)


def _three() -> GPT:
    torch.manual_seed(0)
    return GPT(THREE)


def _ranges(kw: dict[str, Any], trace: Path) -> tuple[list[str], list[str]]:
    """(recorded, planned) collective range names, in issue order, of one steady-state step of rank 1
    of a 2x2 world."""
    from zeropp.experiments.runner.profiling import read_step

    units = profiled_step_ranges(kw, rank=1, world=4, nodes=2, trace=trace, model=_three, cfg=THREE)
    _, _, spans = read_step(trace)
    plan = build_plan(units, ZeroConfig(**kw), Topology(nodes=2, ranks_per_node=2))
    planned = [plan.range_name(c) for c in plan.collectives if c.kind != CommKind.CONTROL]
    got = [s.name for s in spans if s.parsed.part is None and s.parsed.kind != CommKind.CONTROL]  # by start time
    return got, planned


@pytest.mark.parametrize(
    "kw, kept",
    [
        (dict(stage=3), ("root", "block2")),
        (dict(stage=3, prefetch_depth=0), ("root", "block2")),
        (dict(ZPP, grad_accum_steps=2), ("root", "block2")),  # hpZ secondaries, qwZ rows, two micro-steps
        (dict(stage=3, coalesce_numel=10**9), ("root", "block0-2")),  # one span of every block
    ],
    ids=["stage3", "no-prefetch", "zeropp-accum2", "coalesced"],
)
def test_the_kept_units_backward_gathers_are_gone_and_nothing_else(
    tmp_path: Path, kw: dict[str, Any], kept: tuple[str, ...]
) -> None:
    base_list, base_planned = _ranges(kw, tmp_path / "base" / "trace.json")
    got_list, planned = _ranges(dict(kw, keep_at_turn=True), tmp_path / "kept" / "trace.json")
    main = [n for n in planned if not n.endswith("/cross")]  # (qgZ's cross hop starts when its intra hop is done)
    assert [n for n in got_list if not n.endswith("/cross")] == main  # the engine issues the plan, in its order
    base, got = collections.Counter(base_list), collections.Counter(got_list)
    assert got == collections.Counter(planned) and base == collections.Counter(base_planned)
    gone = base - got
    assert got - base == collections.Counter()  # nothing new
    assert gone and all(n.split("/")[1] == "bwd_all_gather" for n in gone), gone
    assert {u for n in gone for u in kept if f"/{u}/" in n} == set(kept), gone
    micro = kw.get("grad_accum_steps", 1)
    assert sum(gone.values()) % micro == 0 and all(c == micro for c in gone.values())  # every micro-step


def _engine(seen: list[list[str]], **kw: Any) -> ZeroEngine:
    """Stage 3 on the three-block GPT; its loss function (run between forward and backward) notes
    the units still gathered then into ``seen``."""
    eng: ZeroEngine

    def loss_fn(output: Any, mb: Any) -> torch.Tensor:
        seen.append(_gathered(eng))
        return output[-1]

    eng = ZeroEngine(
        _three(),
        config=ZeroConfig(stage=3, **kw),
        optimizer=OptimizerConfig(lr=1e-3),
        topology=Topology(nodes=2, ranks_per_node=2),
        loss_fn=loss_fn,
    )
    return eng


def _gathered(eng: ZeroEngine) -> list[str]:
    return sorted(u.name for u in eng.stage3.all_units if u.kind in GATHERED and u.state != "free")


@pytest.mark.parametrize("prefetch", [0, 2])
def test_exactly_the_root_and_the_last_block_stay_between_forward_and_backward(prefetch: int) -> None:
    """At the turn (the loss) the kept units are gathered, and nothing else; without the option
    nothing is. Eval, a no-grad forward and a forward outside ``train_step`` keep nothing, and the
    gather pool allocates the same buffers either way (no extra memory)."""
    allocations = {}
    with fake_world(1, 4):
        for keep in (False, True):
            seen: list[list[str]] = []
            eng = _engine(seen, keep_at_turn=keep, prefetch_depth=prefetch, grad_accum_steps=2)
            try:
                for s in range(2):
                    eng.train_step(rank_batches(s, 2, 1, THREE))
                assert seen == [["block2", "root"] if keep else []] * 4, seen
                allocations[keep] = eng.buffers.allocations
                seen.clear()
                eng.eval_loss(micro_batch(7, 0, 1, THREE))
                idx, targets = micro_batch(8, 0, 1, THREE)
                with torch.no_grad():
                    eng.model(idx, targets)
                assert _gathered(eng) == []
                with torch.enable_grad():
                    _, loss = eng.model(idx, targets)  # a user's forward outside train_step
                assert loss.requires_grad and _gathered(eng) == []
                assert seen == [[]]  # (eval_loss's loss, after its forward)
            finally:
                eng.close()
    assert allocations[True] == allocations[False], allocations
