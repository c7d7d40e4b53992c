"""The scaling model's bytes are the engine's bytes. ``experiments.scaling``'s messages are the
communication plan's (``zeropp.runtime.plan``), checked here for every configuration of
``plan_helpers.WORLDS`` -- every quantization preset of ``zeropp.comm.spec.RECIPES`` at the stages it
applies to, hpZ on and off, bucket chunking, gradient accumulation, awkward topologies, qWD's steady
state -- and the plan is checked against the engine's CommStats for the same set in one process
(``tests/test_runtime_plan.py``). End to end, one real 4-rank gloo world (2x2 and 1x4, and tp=2)
compares CommStats on every rank, and each node's uplink, with the model."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from tests.distributed import run_world
from tests.plan_helpers import SMALL_BUCKETS, WORLDS, ZPP
from tests.runtime_helpers import TINY, rank_batches, train_engine
from zeropp.comm.spec import RECIPES, QuantSpec
from zeropp.experiments.scaling import Cluster, Workload, gpt_units, messages, pairwise_bytes, uplink_bytes
from zeropp.models import GPT

UNITS = gpt_units(vocab=TINY.vocab_size, seq_len=TINY.seq_len, d_model=TINY.d_model, n_layers=TINY.n_layers,
                  mlp_ratio=TINY.mlp_ratio)


E2E: list[tuple[int, list[dict[str, Any]]]] = [
    (2, [{**ZPP, **SMALL_BUCKETS, "grad_accum_steps": 2}, dict(stage=0),
         dict(stage=2, hpz=False, grads=RECIPES["qgz"].grads, weight_diff=QuantSpec(bits=8, group_size=64),
              **SMALL_BUCKETS)]),
    (1, [ZPP])]
"""(nodes, configs) of the 4-rank gloo world: the end-to-end check of the byte model (every recipe,
stage and topology of ``plan_helpers.WORLDS`` is checked in one process, ``tests/test_runtime_plan.py``)."""
TP_CONFIGS = [ZPP, dict(stage=2, grads=RECIPES["qgz"].grads, reduce_bucket_size=999), dict(stage=1)]
"""Tensor parallelism (tp=2 on 2x2): ZeRO over the data-parallel ranks, with the units' TP-local sizes."""


def _steady(kw: dict[str, Any], rank: int, world: int, nodes: int) -> dict[str, dict[str, int]]:
    """This rank's CommStats of one step in the steady state: the first step, or with weight
    differences (whose first step still makes the stage-3 secondaries) the second one."""
    if kw.get("weight_diff") is None:
        return train_engine(rank, world, kw, steps=1, nodes=nodes, consolidate=False)["comm"]
    first, second = train_engine(rank, world, kw, steps=2, nodes=nodes, consolidate=False)["comm_per_step"]
    return {k: {ln: b - first.get(k, {}).get(ln, 0) for ln, b in links.items()} for k, links in second.items()}


def _tp_step(rank: int, world: int, kw: dict[str, Any]) -> tuple[tuple, dict[str, dict[str, int]]]:
    """One step of a tp=2 engine on 2x2: the TP-local units (``plan_units``) and this rank's CommStats."""
    from zeropp.comm import Topology
    from zeropp.runtime import OptimizerConfig, ZeroConfig, ZeroEngine
    from zeropp.runtime.plan import plan_units
    from zeropp.runtime.tensor_parallel import make_mesh, parallelize

    topo = Topology(nodes=2, ranks_per_node=world // 2, tp=2)
    torch.manual_seed(0)
    m = parallelize(GPT(TINY), make_mesh(topo))
    units = plan_units(m)
    eng = ZeroEngine(m, config=ZeroConfig(**kw), optimizer=OptimizerConfig(lr=1e-3), topology=topo)
    try:
        eng.train_step(rank_batches(0, ZeroConfig(**kw).grad_accum_steps, topo.dp_index(rank), TINY))
        return units, eng.comm_stats.snapshot()
    finally:
        eng.close()


def _steps(rank: int, world: int, plan: list[tuple[int, list[dict[str, Any]]]]) -> list[list[Any]]:
    """One (steady-state) step of each config under each topology, then of each tensor-parallel
    config; this rank's CommStats snapshots."""
    return [*([_steady(kw, rank, world, nodes) for kw in cfgs] for nodes, cfgs in plan),
            [_tp_step(rank, world, kw) for kw in TP_CONFIGS]]


def _flat(snap: dict[str, dict[str, int]]) -> dict[str, int]:
    return {f"{kind}.{link}": b for kind, links in snap.items() for link, b in links.items() if b}


def _predicted(kw: dict[str, Any], nodes: int, rpn: int) -> tuple[dict[str, float], Cluster, Workload]:
    from zeropp.runtime import ZeroConfig

    w = Workload.from_zero(ZeroConfig(**kw), units=UNITS, compute_s=0.0, tokens_per_rank=1)
    c = Cluster(nodes=nodes, ranks_per_node=rpn, cross_gbps=1.0, nics_per_node=1)
    return pairwise_bytes(messages(w, c)), c, w


def test_predicted_bytes_equal_commstats() -> None:
    """On a real 4-rank gloo world: the byte model (and so the plan it reads) is what the engine
    sends, per kind and link on every rank and per node uplink; with tp=2 the plan of the TP-local
    units is."""
    from zeropp.comm import Topology
    from zeropp.runtime import ZeroConfig
    from zeropp.runtime.plan import build_plan

    world, plan = 4, E2E
    per_rank = run_world(_steps, world, plan, timeout=300)
    for i, kw in enumerate(TP_CONFIGS):
        for rank in range(world):
            units, snap = per_rank[rank][len(plan)][i]
            tp_plan = build_plan(units, ZeroConfig(**kw), Topology(nodes=2, ranks_per_node=2, tp=2))
            assert _flat(snap) == tp_plan.bytes_by_kind(), f"tp=2 rank {rank} {kw}"
    for t, (nodes, cfgs) in enumerate(plan):
        rpn = world // nodes
        for i, kw in enumerate(cfgs):
            pred, c, w = _predicted(kw, nodes, rpn)
            where = f"{nodes}x{rpn} {kw}"
            for rank in range(world):
                assert _flat(per_rank[rank][t][i]) == pred, f"rank {rank}, {where}"
            # a node's uplink: the node's ranks' accounted cross-node bytes, summed
            for node in range(nodes):
                sent = sum(_flat(per_rank[r][t][i]).get(k, 0) for r in range(node * rpn, (node + 1) * rpn)
                           for k in _flat(per_rank[r][t][i]) if k.endswith(".cross"))
                assert sent == uplink_bytes(messages(w, c), c), f"node {node}, {where}"


@pytest.mark.parametrize("world", sorted(WORLDS))
def test_model_bytes_are_the_plans(world: int) -> None:
    """Per kind and link, the byte model's pairwise bytes are the plan's; a node's uplink (one NIC,
    pairwise wire) carries its ranks' cross-node bytes."""
    from zeropp.comm import Topology
    from zeropp.runtime import ZeroConfig
    from zeropp.runtime.plan import build_plan

    for nodes, cfgs in WORLDS[world]:
        rpn = world // nodes
        for kw in cfgs:
            pred, c, w = _predicted(kw, nodes, rpn)
            plan = build_plan(UNITS, ZeroConfig(**kw), Topology(nodes=nodes, ranks_per_node=rpn))
            assert pred == plan.bytes_by_kind(), (nodes, kw)
            cross = sum(b for k, b in pred.items() if k.endswith(".cross"))
            assert uplink_bytes(messages(w, c), c) == rpn * cross, (nodes, kw)


def test_configs_cover_every_recipe_and_stage() -> None:
    """The checked set (``plan_helpers.WORLDS``) really holds every preset (and hpZ both ways at stage 3)."""
    cfgs = WORLDS[4][0][1]
    for name, r in RECIPES.items():
        assert any(kw.get("weights") == r.weights and kw.get("grads") == r.grads and kw["hpz"] == r.hpz
                   and kw.get("weight_diff") == r.weight_diff for kw in cfgs), name
    assert {kw["stage"] for kw in cfgs if kw.get("weight_diff")} == {1, 2, 3}
    assert {kw["stage"] for kw in cfgs} == {0, 1, 2, 3}
    assert any(kw["hpz"] for kw in cfgs) and any(kw["stage"] == 3 and not kw["hpz"] for kw in cfgs)


def test_ring_wire_moves_fewer_gather_bytes_than_pairwise() -> None:
    """gloo's ring all-gather leaves a node over one edge with g - 1 shards; pairwise sends would
    push ranks x cross peers shards through the same uplink (the 2x2 emulator: 3 vs 4)."""
    w = dataclasses.replace(Workload.from_zero(type("Z", (), {**ZPP, "precision": "fp32", "hpz_size": None,
                                                               "grad_accum_steps": 1})(),
                                               units=UNITS, compute_s=0.0, tokens_per_rank=1))
    ring = Cluster(nodes=2, ranks_per_node=2, cross_gbps=1.0, nics_per_node=1, wire="ring")
    pair = dataclasses.replace(ring, wire="pairwise")
    fwd = [m for m in messages(w, ring) if m.kind == "fwd_all_gather"]
    assert uplink_bytes(fwd, ring) * 4 == uplink_bytes(fwd, pair) * 3
    rs = [m for m in messages(w, ring) if m.kind == "grad_reduce_scatter"]
    assert uplink_bytes(rs, ring) == uplink_bytes(rs, pair)  # all-to-alls are pairwise on both
