"""The scaling model's bytes are the engine's bytes: one real training step per configuration on
gloo worlds, CommStats (by kind and link, on every rank) against ``experiments.scaling``'s
messages, exactly -- every quantization preset of ``zeropp.comm.spec.RECIPES`` at the stages it
applies to, hpZ on and off, bucket chunking, gradient accumulation, awkward topologies; with
weight differences (qWD) the second step's bytes (the steady state the model describes).

One world launch runs many engines one after another (a launch costs seconds), and one world
hosts several topologies (4 ranks: 1x4, 2x2 and 4x1)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from tests.distributed import run_world
from tests.runtime_helpers import TINY, train_engine
from zeropp.comm.spec import RECIPES, QuantSpec
from zeropp.experiments.scaling import Cluster, Workload, gpt_units, messages, pairwise_bytes, uplink_bytes

UNITS = gpt_units(vocab=TINY.vocab_size, seq_len=TINY.seq_len, d_model=TINY.d_model, n_layers=TINY.n_layers,
                  mlp_ratio=TINY.mlp_ratio)


def _recipe_configs() -> list[dict[str, Any]]:
    """Every recipe at every stage it is valid for, and hpZ on/off where weights are sharded."""
    out: list[dict[str, Any]] = []
    for r in RECIPES.values():
        for stage in (0, 1, 2, 3):
            if (r.weights or r.hpz) and stage != 3 or r.grads and stage == 0:
                continue
            for hpz in sorted({r.hpz, True} if stage == 3 else {False}):
                kw = dict(stage=stage, weights=r.weights, grads=r.grads, hpz=hpz)
                if r.weight_diff is not None:
                    if stage == 0 or (stage == 3 and not hpz):
                        continue  # qWD refreshes stages 1-2 replicas or stage 3's hpZ secondaries
                    kw["weight_diff"] = r.weight_diff
                if kw not in out:
                    out.append(kw)
    return out


ZPP = dict(stage=3, weights=RECIPES["zeropp"].weights, grads=RECIPES["zeropp"].grads, hpz=True)
SMALL_BUCKETS = dict(allgather_bucket_size=1000, reduce_bucket_size=3001)  # several chunks per unit, ragged last

# (nodes, configs) per world size: every (topology, config) pair is checked on every rank
WORLDS: dict[int, list[tuple[int, list[dict[str, Any]]]]] = {
    4: [(2, _recipe_configs() + [
            {**ZPP, **SMALL_BUCKETS, "grad_accum_steps": 2},
            dict(stage=1, grads=RECIPES["qgz"].grads, **SMALL_BUCKETS),
            dict(stage=2, grads=QuantSpec(bits=4, intra_bits=8, group_size=64)),
            dict(stage=3, weights=QuantSpec(bits=4, group_size=100), hpz=False, grad_accum_steps=2),
            dict(stage=0, grad_accum_steps=2), dict(stage=1, grad_accum_steps=2),
            # qWD at stages 1-2 (quant=qwd zero.hpz=false): the parameter refresh sends differences
            dict(stage=1, hpz=False, weight_diff=RECIPES["qwd"].weight_diff),
            dict(stage=2, hpz=False, grads=RECIPES["qgz"].grads, weight_diff=QuantSpec(bits=8, group_size=64),
                 **SMALL_BUCKETS)]),
        (1, [ZPP, dict(stage=2, grads=RECIPES["qgz"].grads), dict(stage=0)]),  # one node: hpZ and qgZ in the node
        (4, [ZPP, dict(stage=1, grads=RECIPES["w8g4"].grads)])],  # one rank per node: hpZ group of 1
    6: [(3, [ZPP, {**ZPP, "grad_accum_steps": 2}, dict(stage=0), dict(stage=1, grads=RECIPES["qgz"].grads),
             dict(stage=3, weights=RECIPES["w4g4"].weights, grads=RECIPES["w4g4"].grads, **SMALL_BUCKETS),
             dict(stage=3, weights=RECIPES["sdp4bit"].weights, grads=RECIPES["sdp4bit"].grads, hpz=True,
                  weight_diff=RECIPES["sdp4bit"].weight_diff, **SMALL_BUCKETS)]),
        (2, [ZPP])],
    8: [(2, [{**ZPP, "hpz_size": 2}, dict(stage=2, grads=RECIPES["qgz"].grads, **SMALL_BUCKETS)])],
}


def _steady(kw: dict[str, Any], rank: int, world: int, nodes: int) -> dict[str, dict[str, int]]:
    """This rank's CommStats of one step in the steady state: the first step, or with weight
    differences (whose first step still makes the stage-3 secondaries) the second one."""
    if kw.get("weight_diff") is None:
        return train_engine(rank, world, kw, steps=1, nodes=nodes, consolidate=False)["comm"]
    first, second = train_engine(rank, world, kw, steps=2, nodes=nodes, consolidate=False)["comm_per_step"]
    return {k: {ln: b - first.get(k, {}).get(ln, 0) for ln, b in links.items()} for k, links in second.items()}


def _steps(rank: int, world: int, plan: list[tuple[int, list[dict[str, Any]]]]) -> list[list[dict]]:
    """One (steady-state) step of each config under each topology; this rank's CommStats snapshots."""
    return [[_steady(kw, rank, world, nodes) for kw in cfgs] for nodes, cfgs in plan]


def _flat(snap: dict[str, dict[str, int]]) -> dict[str, int]:
    return {f"{kind}.{link}": b for kind, links in snap.items() for link, b in links.items() if b}


def _predicted(kw: dict[str, Any], nodes: int, rpn: int) -> tuple[dict[str, float], Cluster, Workload]:
    from zeropp.runtime import ZeroConfig

    w = Workload.from_zero(ZeroConfig(**kw), units=UNITS, compute_s=0.0, tokens_per_rank=1)
    c = Cluster(nodes=nodes, ranks_per_node=rpn, cross_gbps=1.0, nics_per_node=1)
    return pairwise_bytes(messages(w, c)), c, w


@pytest.mark.parametrize("world", sorted(WORLDS))
def test_predicted_bytes_equal_commstats(world: int) -> None:
    plan = WORLDS[world]
    per_rank = run_world(_steps, world, plan, timeout=300)
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


def test_configs_cover_every_recipe_and_stage() -> None:
    """The parametrised set really holds every preset (and hpZ both ways at stage 3)."""
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
