"""The scaling model's bytes are the engine's bytes. ``experiments.projection.scaling``'s messages are the
communication plan's (``zeropp.runtime.plan``), checked here for every configuration of
``plan_helpers.WORLDS`` -- every quantization preset of ``zeropp.comm.spec.RECIPES`` at the stages it
applies to, hpZ on and off, bucket chunking, gradient accumulation, awkward topologies, qWD's steady
state -- and the plan is checked against the engine's CommStats for the same set in one process
(``tests/unit/test_runtime_plan.py``). End to end, one real 4-rank gloo world (2x2 and 1x4, and tp=2)
compares CommStats on every rank, and each node's uplink, with the model.

Here: the gloo-world checks of this topic; its other tiers' checks are in
``tests/unit/test_scaling_bytes.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.plan_helpers import SMALL_BUCKETS, ZPP, predicted_bytes
from tests.runtime_helpers import TINY, rank_batches, train_engine
from tests.worlds import run_world
from zeropp.comm.spec import RECIPES, QuantSpec
from zeropp.experiments.projection.scaling import messages, uplink_bytes
from zeropp.models import GPT

E2E: list[tuple[int, list[dict[str, Any]]]] = [
    (
        2,
        [
            {**ZPP, **SMALL_BUCKETS, "grad_accum_steps": 2},
            dict(stage=0),
            dict(
                stage=2,
                hpz=False,
                grads=RECIPES["qgz"].grads,
                weight_diff=QuantSpec(bits=8, group_size=64),
                **SMALL_BUCKETS,
            ),
        ],
    ),
    (1, [ZPP]),
]
"""(nodes, configs) of the 4-rank gloo world: the end-to-end check of the byte model (every recipe,
stage and topology of ``plan_helpers.WORLDS`` is checked in one process, ``tests/unit/test_runtime_plan.py``)."""
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
    return [
        *([_steady(kw, rank, world, nodes) for kw in cfgs] for nodes, cfgs in plan),
        [_tp_step(rank, world, kw) for kw in TP_CONFIGS],
    ]


def _flat(snap: dict[str, dict[str, int]]) -> dict[str, int]:
    return {f"{kind}.{link}": b for kind, links in snap.items() for link, b in links.items() if b}


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
            pred, c, w = predicted_bytes(kw, nodes, rpn)
            where = f"{nodes}x{rpn} {kw}"
            for rank in range(world):
                assert _flat(per_rank[rank][t][i]) == pred, f"rank {rank}, {where}"
            # a node's uplink: the node's ranks' accounted cross-node bytes, summed
            for node in range(nodes):
                sent = sum(
                    _flat(per_rank[r][t][i]).get(k, 0)
                    for r in range(node * rpn, (node + 1) * rpn)
                    for k in _flat(per_rank[r][t][i])
                    if k.endswith(".cross")
                )
                assert sent == uplink_bytes(messages(w, c), c), f"node {node}, {where}"
