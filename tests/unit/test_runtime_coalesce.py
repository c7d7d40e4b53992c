"""Coalesced units (``ZeroConfig.coalesce_numel``): consecutive blocks under the threshold share one unit.

* the grouping rule (``blocks.coalesce_spans``) on chosen sizes, and its invariants;
* the engine's units are the spans' (``block<i>-<j>``), at stage 3 and, alike, at stage 2 (so a
  checkpoint moves between stages), and stage 3 hooks one gather group per span;
* the communication plan coalesces as the engine does: a steady-state step's profiler ranges are the
  plan's entries call for call, and its bytes per kind and link are the plan's, for ZeRO++ with
  buckets and accumulation, MixZ++ frozen units (a span of a trainable and an all-frozen block),
  stage 2 and stage 0;
* the one-unit warning names ``coalesce_numel`` when coalescing made the one unit.
"""

from __future__ import annotations

import collections
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.plan_helpers import SMALL_BUCKETS, ZPP, fake_world, profiled_step_ranges, steady_step_bytes
from tests.runtime_helpers import TINY
from zeropp.comm import Topology
from zeropp.models import GPT
from zeropp.runtime import ZeroConfig, ZeroEngine
from zeropp.runtime.blocks import BlockChoiceWarning, coalesce_spans
from zeropp.runtime.plan import build_plan, plan_units
from zeropp.runtime.plan_kinds import CommKind

pytestmark = pytest.mark.usefixtures("one_torch_thread")

THREE = TINY.with_(n_layers=3)
"""The tiny GPT with three blocks, so a threshold of two blocks leaves one block alone."""
BLOCK = plan_units(GPT(THREE))[1].numel
PAIR = 2 * BLOCK
"""Blocks 0 and 1 fit together, block 2 does not: units ``block0-1`` and ``block2``."""


def _three() -> GPT:
    torch.manual_seed(0)
    return GPT(THREE)


def _frozen_three() -> GPT:
    """pos_emb frozen in the root, block 1 frozen entirely: its span with block 0 has a trainable
    part (block 0's) and a frozen part (block 1's)."""
    m = _three()
    m.pos_emb.weight.requires_grad_(False)
    for p in m.blocks[1].parameters():
        p.requires_grad_(False)
    return m


@pytest.mark.parametrize(
    "sizes,threshold,spans",
    [
        ([3, 3, 3], 0, [(0, 0), (1, 1), (2, 2)]),
        ([3, 3, 3], 5, [(0, 0), (1, 1), (2, 2)]),
        ([3, 3, 3], 6, [(0, 1), (2, 2)]),
        ([3, 3, 3], 9, [(0, 2)]),
        ([10, 3, 3], 6, [(0, 0), (1, 2)]),  # a block over the threshold is alone
        ([3, 10, 3], 6, [(0, 0), (1, 1), (2, 2)]),
        ([0, 0, 4], 0, [(0, 0), (1, 1), (2, 2)]),  # 0: one per block, even empty ones
        ([], 6, []),
    ],
)
def test_coalesce_spans(sizes: list[int], threshold: int, spans: list[tuple[int, int]]) -> None:
    got = coalesce_spans(sizes, threshold)
    assert got == spans
    assert [i for a, b in got for i in range(a, b + 1)] == list(range(len(sizes)))  # every block once, in order
    for a, b in got:
        assert a == b or sum(sizes[a : b + 1]) <= threshold


def test_a_negative_threshold_is_refused_with_its_name() -> None:
    from zeropp.experiments.projection.spec import Workload

    with pytest.raises(ValueError, match="coalesce_numel must be >= 0"):
        ZeroConfig(stage=3, coalesce_numel=-1)
    with pytest.raises(ValueError, match=r"Workload.coalesce=-1; use >= 0"):
        Workload(units=(10, 10), compute_s=0.0, tokens_per_rank=1, coalesce=-1)
    assert (
        Workload.from_zero(ZeroConfig(coalesce_numel=7), units=(10, 10), compute_s=0.0, tokens_per_rank=1).coalesce == 7
    )


@pytest.mark.parametrize("stage", [2, 3])
def test_engine_units_are_the_spans(stage: int) -> None:
    with fake_world(0, 4):
        m = _three()
        eng = ZeroEngine(m, config=ZeroConfig(stage=stage, coalesce_numel=PAIR), topology=Topology.single_node(4))
        try:
            assert [u.name for u in eng.units] == ["root", "block0-1", "block2"]
            pair = eng.units[1]
            names = [n for n, _ in m.named_parameters() if n.startswith(("blocks.0.", "blocks.1."))]
            assert [s.name for s in pair.slots] == names and pair.numel == PAIR
            assert [blk for blk, _ in eng.blocks] == list(m.blocks)  # every block keeps its hooks
            if stage == 3:
                assert [[u.name for u in g] for g in eng.stage3.groups] == [["block0-1"], ["block2"]]
            assert eng.reducer.reduce_order == [eng.units[2], eng.units[1], eng.units[0]]
        finally:
            eng.close()


@pytest.mark.parametrize("coalesce, depth", [(0, 1), (0, 5), (PAIR, 5), (10**9, 1), (10**9, 3)])
def test_the_pool_reserves_no_more_gathers_than_there_are_distinct_block_units(coalesce: int, depth: int) -> None:
    """The gather pool holds the root's slot and min(prefetch_depth + 1, distinct block units) slots
    of the largest block unit: coalesced blocks share a unit, so its buffer is counted once, and a
    prefetch deeper than the model never reserves slots that can never be in use."""
    with fake_world(0, 4):
        cfg = ZeroConfig(stage=3, coalesce_numel=coalesce, prefetch_depth=depth)
        eng = ZeroEngine(_three(), config=cfg, topology=Topology.single_node(4))
        try:
            distinct = {id(u): u for _, u in eng.blocks}
            root = eng.root
            assert root is not None
            slots = [t.numel() for t in eng.buffers._slots["gather"]]
            live = min(depth + 1, len(distinct))
            assert sorted(slots) == sorted([root.padded] + [max(u.padded for u in distinct.values())] * live)
            assert len(eng.buffers._slots["grad_flat"]) == min(2, len(eng.units))
        finally:
            eng.close()


CASES: list[tuple[str, dict[str, Any], Any]] = [
    ("zeropp-buckets-accum", {**ZPP, **SMALL_BUCKETS, "grad_accum_steps": 2, "coalesce_numel": PAIR}, _three),
    ("mixz-int8-hpz", dict(stage=3, quantize_frozen="int8", hpz=True, coalesce_numel=PAIR), _frozen_three),
    ("stage3-all", dict(stage=3, prefetch_depth=2, coalesce_numel=10**9), _three),
    ("stage2", dict(stage=2, coalesce_numel=PAIR), _three),
    ("stage0-accum", dict(stage=0, grad_accum_steps=2, coalesce_numel=PAIR), _three),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_coalesced_plan_is_the_engines_call_for_call(case: tuple, tmp_path: Path) -> None:
    """Profiler ranges (one per call, named by unit and bucket) and bytes per kind and link: the
    plan's, built from the per-block units the way the engine coalesces them."""
    _, kw, model = case
    trace = tmp_path / "trace.json"
    units = profiled_step_ranges(kw, rank=1, world=4, nodes=2, trace=trace, model=model, cfg=THREE)
    from zeropp.experiments.runner.profiling import read_step

    _, _, spans = read_step(trace)
    plan = build_plan(units, ZeroConfig(**kw), Topology(nodes=2, ranks_per_node=2))
    planned = collections.Counter(plan.range_name(c) for c in plan.collectives if c.kind != CommKind.CONTROL)
    got = collections.Counter(s.name for s in spans if s.parsed.part is None and s.parsed.kind != CommKind.CONTROL)
    assert got == planned
    coalesced = [u.name for u in plan.units if "-" in u.name]
    assert coalesced and all(any(f"/{n}/" in name for name in got) for n in coalesced)  # the merged units moved
    units, measured = steady_step_bytes(kw, rank=1, world=4, nodes=2, model=model, cfg=THREE)
    assert build_plan(units, ZeroConfig(**kw), Topology(nodes=2, ranks_per_node=2)).bytes_by_kind() == measured


def test_fewer_units_mean_fewer_collectives() -> None:
    """The point of coalescing: the plan of the three-block GPT at stage 3 issues fewer calls."""
    units, topo = plan_units(_three()), Topology(nodes=1, ranks_per_node=4)

    def calls(c: int) -> int:
        plan = build_plan(units, ZeroConfig(stage=3, coalesce_numel=c), topo)
        return sum(x.kind != CommKind.CONTROL for x in plan.collectives)

    assert calls(0) > calls(PAIR) > calls(10**9)


def test_one_unit_warning_names_the_threshold_that_merged_every_block() -> None:
    def seq() -> nn.Sequential:  # a fresh one per engine: stage 3 leaves a wrapped model's parameters empty
        return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 4))

    with fake_world(0, 2):
        with warnings.catch_warnings():
            warnings.simplefilter("error", BlockChoiceWarning)
            ZeroEngine(seq(), config=ZeroConfig(stage=3), topology=Topology.single_node(2)).close()  # 3 units
        with pytest.warns(BlockChoiceWarning, match=r"coalesce_numel=1,000 merged every block .*'block0-2'"):
            ZeroEngine(seq(), config=ZeroConfig(stage=3, coalesce_numel=1000), topology=Topology.single_node(2)).close()


def test_a_block_without_parameters_inside_a_span_gets_no_hooks_and_no_extra_gather() -> None:
    """A policy that picks a parameter-free module (a ReLU) between two linears: coalesced, the unit
    is ``block0-2`` hooked on the two linears only, and a step's gathers and reduce-scatters are the
    plan's, call for call per kind (an inner hook would gather the unit again in backward)."""
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    policy = lambda name, m: name in {"0", "1", "2"}  # noqa: E731
    kw = dict(stage=3, coalesce_numel=10**6)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    units = plan_units(seq, policy)  # before the engine empties the parameters
    with fake_world(0, 2), pytest.warns(BlockChoiceWarning, match="merged every block"):
        eng = ZeroEngine(
            seq,
            config=ZeroConfig(**kw),
            topology=Topology.single_node(2),
            blocks=policy,
            loss_fn=lambda out, mb: nn.functional.mse_loss(out, y),
        )
        try:
            assert [u.name for u in eng.units] == ["block0-2"]
            assert [blk for blk, _ in eng.blocks] == [seq[0], seq[2]]
            calls = []
            for _ in range(2):
                eng.train_step([x])
                calls.append(eng.comm_stats.calls())
        finally:
            eng.close()
    step = {k: calls[1][k] - calls[0].get(k, 0) for k in calls[1]}
    plan = build_plan(units, ZeroConfig(**kw), Topology.single_node(2))
    planned = collections.Counter(str(c.kind) for c in plan.collectives if c.counted)
    assert {k: v for k, v in step.items() if v} == dict(planned)
