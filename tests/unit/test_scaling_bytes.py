"""The scaling model's bytes are the engine's bytes.

Here: the one-process checks. The topic's full description and its gloo-world checks are in
``tests/distributed/test_scaling_bytes.py``.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.plan_helpers import TINY_UNITS, WORLDS, ZPP, predicted_bytes
from zeropp.comm.codecs import codecs
from zeropp.comm.spec import RECIPES
from zeropp.experiments.scaling import Cluster, Workload, messages, uplink_bytes


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
            pred, c, w = predicted_bytes(kw, nodes, rpn)
            plan = build_plan(TINY_UNITS, ZeroConfig(**kw), Topology(nodes=nodes, ranks_per_node=rpn))
            assert pred == plan.bytes_by_kind(), (nodes, kw)
            cross = sum(b for k, b in pred.items() if k.endswith(".cross"))
            assert uplink_bytes(messages(w, c), c) == rpn * cross, (nodes, kw)


def test_configs_cover_every_recipe_and_stage() -> None:
    """The checked set (``plan_helpers.WORLDS``) really holds every preset (and hpZ both ways at stage 3)."""
    cfgs = WORLDS[4][0][1]
    for name, r in RECIPES.items():
        assert any(
            kw.get("weights") == r.weights
            and kw.get("grads") == r.grads
            and kw["hpz"] == r.hpz
            and kw.get("weight_diff") == r.weight_diff
            for kw in cfgs
        ), name
    assert {kw["stage"] for kw in cfgs if kw.get("weight_diff")} == {1, 2, 3}
    assert {kw["stage"] for kw in cfgs} == {0, 1, 2, 3}
    assert any(kw["hpz"] for kw in cfgs) and any(kw["stage"] == 3 and not kw["hpz"] for kw in cfgs)
    # and every registered codec, in the weights, both qgZ hops and the weight differences
    for scheme in codecs():
        assert any(
            kw.get("weights")
            and kw.get("grads")
            and kw.get("weight_diff")
            and {kw["weights"].scheme, kw["grads"].scheme, kw["weight_diff"].scheme} == {scheme}
            for kw in cfgs
        ), scheme


def test_ring_wire_moves_fewer_gather_bytes_than_pairwise() -> None:
    """gloo's ring all-gather leaves a node over one edge with g - 1 shards; pairwise sends would
    push ranks x cross peers shards through the same uplink (the 2x2 emulator: 3 vs 4)."""
    w = dataclasses.replace(
        Workload.from_zero(
            type("Z", (), {**ZPP, "precision": "fp32", "hpz_size": None, "grad_accum_steps": 1})(),
            units=TINY_UNITS,
            compute_s=0.0,
            tokens_per_rank=1,
        )
    )
    ring = Cluster(nodes=2, ranks_per_node=2, cross_gbps=1.0, nics_per_node=1, wire="ring")
    pair = dataclasses.replace(ring, wire="pairwise")
    fwd = [m for m in messages(w, ring) if m.kind == "fwd_all_gather"]
    assert uplink_bytes(fwd, ring) * 4 == uplink_bytes(fwd, pair) * 3
    rs = [m for m in messages(w, ring) if m.kind == "grad_reduce_scatter"]
    assert uplink_bytes(rs, ring) == uplink_bytes(rs, pair)  # all-to-alls are pairwise on both
