"""The engine's own byte accounting in one process: a ZeroEngine step on torch's fake process group.

Why: checking a communication plan against ``CommStats`` needs the engine to run as one rank of a
larger world, but launching gloo worlds costs seconds each. torch's ``fake`` backend
(``torch.testing._internal.distributed.fake_pg``, what torch's own tests and dry runs use) lets one
process be rank ``r`` of ``W``: every collective returns at once without moving data. The values
computed are meaningless, but every collective the engine issues, with its sizes, goes through
``zeropp.comm``'s accounting exactly as on a real world (``tests/distributed/test_scaling_bytes.py`` keeps a
real gloo world as the end-to-end check), so ``CommStats`` records the bytes the engine sends.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from tests.codec_cases import two_hop_specs
from tests.runtime_helpers import TINY, rank_batches
from zeropp.comm.spec import RECIPES, QuantSpec, schemes
from zeropp.experiments.projection.scaling import gpt_units, messages, pairwise_bytes
from zeropp.experiments.projection.spec import Cluster, Workload
from zeropp.models import GPT, GPTConfig
from zeropp.runtime.plan import PlanUnit, plan_units


@contextlib.contextmanager
def fake_world(rank: int, world: int) -> Iterator[None]:
    """This process as rank ``rank`` of a ``world``-rank fake process group (destroyed on exit)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def tiny_gpt(cfg: GPTConfig = TINY) -> GPT:
    torch.manual_seed(0)
    return GPT(cfg)


def steady_step_bytes(
    zero_kwargs: dict[str, Any],
    *,
    rank: int,
    world: int,
    nodes: int,
    tp: int = 1,
    model: Callable[[], nn.Module] = tiny_gpt,
    cfg: GPTConfig = TINY,
) -> tuple[tuple[PlanUnit, ...], dict[str, int]]:
    """``(units, bytes)``: the model's units (``plan_units``, TP-local when ``tp > 1``) and the
    ``{"<kind>.<link>": bytes}`` this rank's engine records in its second training step (the steady
    state a plan describes: qWD and frozen hpZ secondaries exist from the first step on), on a fake
    world of ``nodes`` nodes (``tp``: tensor-parallel degree)."""
    from zeropp.comm import Topology
    from zeropp.runtime import OptimizerConfig, ZeroConfig, ZeroEngine

    zc = ZeroConfig(**zero_kwargs)
    topo = Topology(nodes=nodes, ranks_per_node=world // nodes, tp=tp)
    with fake_world(rank, world):
        m = model()
        if tp > 1:
            from zeropp.runtime.tensor_parallel import make_mesh, parallelize

            m = parallelize(m, make_mesh(topo))
        units = plan_units(m)
        eng = ZeroEngine(m, config=zc, optimizer=OptimizerConfig(lr=1e-3), topology=topo)
        try:
            dp = topo.dp_index(rank)
            snaps = []
            for s in range(2):
                eng.train_step(rank_batches(s, zc.grad_accum_steps, dp, cfg))
                snaps.append(eng.comm_stats.snapshot())
        finally:
            eng.close()
    first, second = snaps
    return units, {
        f"{k}.{ln}": b - first.get(k, {}).get(ln, 0)
        for k, links in second.items()
        for ln, b in links.items()
        if b - first.get(k, {}).get(ln, 0)
    }


def recipe_configs() -> list[dict[str, Any]]:
    """Every recipe of ``zeropp.comm.spec.RECIPES`` at every stage it is valid for, and hpZ on/off
    where weights are sharded (``ZeroConfig`` keyword arguments)."""
    out: list[dict[str, Any]] = []
    for r in RECIPES.values():
        for stage in (0, 1, 2, 3):
            if ((r.weights or r.hpz) and stage != 3) or (r.grads and stage == 0):
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
"""The full ZeRO++ switches (qwZ INT8, hpZ, qgZ INT4)."""
SMALL_BUCKETS = dict(allgather_bucket_size=1000, reduce_bucket_size=3001)
"""Several chunks per unit of the tiny GPT, the last one ragged."""


def registry_configs() -> list[dict[str, Any]]:
    """Every registered codec (``tests/codec_cases.py``) in every quantized collective of the
    engine: stage 3 with its widest width for the weights, qgZ from its widest width inside the node
    to its narrowest across, its narrowest for hpZ's weight differences, ragged buckets; and
    stage 1's qgZ."""
    out: list[dict[str, Any]] = []
    for g in two_hop_specs(group_size=64):
        widths = schemes()[g.scheme]
        w, d = g.replace(bits=max(widths), intra_bits=None), g.replace(bits=min(widths), intra_bits=None)
        out.append(dict(stage=3, weights=w, grads=g, hpz=True, weight_diff=d, **SMALL_BUCKETS))
        out.append(dict(stage=1, grads=g, hpz=False))
    return out


TINY_UNITS = gpt_units(
    vocab=TINY.vocab_size, seq_len=TINY.seq_len, d_model=TINY.d_model, n_layers=TINY.n_layers, mlp_ratio=TINY.mlp_ratio
)
"""The scaling model's units of the tiny GPT the engine tests train (``runtime_helpers.TINY``)."""

WORLDS: dict[int, list[tuple[int, list[dict[str, Any]]]]] = {
    4: [
        (
            2,
            recipe_configs()
            + registry_configs()
            + [
                {**ZPP, **SMALL_BUCKETS, "grad_accum_steps": 2},
                {**ZPP, **SMALL_BUCKETS, "coalesce_numel": 10**9},  # the blocks share one unit
                # the root and the last block stay gathered into backward (hpZ, qwZ, chunks, accumulation)
                {**ZPP, **SMALL_BUCKETS, "keep_at_turn": True, "grad_accum_steps": 2},
                dict(stage=3, keep_at_turn=True, coalesce_numel=10**9, prefetch_depth=2),
                dict(stage=1, grads=RECIPES["qgz"].grads, **SMALL_BUCKETS),
                dict(stage=2, grads=QuantSpec(bits=4, intra_bits=8, group_size=64)),
                dict(stage=3, weights=QuantSpec(bits=4, group_size=100), hpz=False, grad_accum_steps=2),
                dict(stage=0, grad_accum_steps=2),
                dict(stage=1, grad_accum_steps=2),
                # qWD at stages 1-2 (quant=qwd zero.hpz=false): the parameter refresh sends differences
                dict(stage=1, hpz=False, weight_diff=RECIPES["qwd"].weight_diff),
                dict(
                    stage=2,
                    hpz=False,
                    grads=RECIPES["qgz"].grads,
                    weight_diff=QuantSpec(bits=8, group_size=64),
                    **SMALL_BUCKETS,
                ),
            ],
        ),
        (1, [ZPP, dict(stage=2, grads=RECIPES["qgz"].grads), dict(stage=0)]),  # one node: hpZ and qgZ in the node
        (4, [ZPP, dict(stage=1, grads=RECIPES["w8g4"].grads)]),
    ],  # one rank per node: hpZ group of 1
    6: [
        (
            3,
            [
                ZPP,
                {**ZPP, "grad_accum_steps": 2},
                dict(stage=0),
                dict(stage=1, grads=RECIPES["qgz"].grads),
                dict(stage=3, weights=RECIPES["w4g4"].weights, grads=RECIPES["w4g4"].grads, **SMALL_BUCKETS),
                dict(
                    stage=3,
                    weights=RECIPES["sdp4bit"].weights,
                    grads=RECIPES["sdp4bit"].grads,
                    hpz=True,
                    weight_diff=RECIPES["sdp4bit"].weight_diff,
                    **SMALL_BUCKETS,
                ),
            ],
        ),
        (2, [ZPP]),
    ],
    8: [(2, [{**ZPP, "hpz_size": 2}, dict(stage=2, grads=RECIPES["qgz"].grads, **SMALL_BUCKETS)])],
}
"""(nodes, configs) per world size: the recipes, stages, hpZ, qWD, buckets, accumulation and awkward
topologies (one node, one rank per node, three nodes, sub-node hpZ groups) whose bytes are checked."""


def profiled_step_ranges(
    zero_kwargs: dict[str, Any],
    *,
    rank: int,
    world: int,
    nodes: int,
    trace: Any,
    model: Callable[[], nn.Module] = tiny_gpt,
    cfg: GPTConfig = TINY,
) -> tuple[PlanUnit, ...]:
    """The model's units; this rank's second training step (the steady state) on a fake world of
    ``nodes`` nodes is recorded by the runner's profiler (``experiments.runner.profiling.StepProfiler``)
    into the Chrome trace file ``trace`` (the first step runs unrecorded)."""
    from pathlib import Path

    from experiments.runner.profiling import StepProfiler, trace_path
    from zeropp.comm import Topology
    from zeropp.runtime import OptimizerConfig, ZeroConfig, ZeroEngine

    zc = ZeroConfig(**zero_kwargs)
    topo = Topology(nodes=nodes, ranks_per_node=world // nodes)
    run_dir = Path(trace).parent
    with fake_world(rank, world):
        m = model()
        units = plan_units(m)
        eng = ZeroEngine(m, config=zc, optimizer=OptimizerConfig(lr=1e-3), topology=topo)
        try:
            with StepProfiler((2,), start=0, run_dir=run_dir, rank=rank, device=torch.device("cpu")) as prof:
                for s in (1, 2):
                    with prof.step(s):
                        eng.train_step(rank_batches(s - 1, zc.grad_accum_steps, topo.dp_index(rank), cfg))
        finally:
            eng.close()
    trace_path(run_dir, rank, 2).rename(trace)
    return units


def predicted_bytes(kw: dict[str, Any], nodes: int, rpn: int) -> tuple[dict[str, float], Cluster, Workload]:
    """The scaling model's pairwise bytes of ``ZeroConfig(**kw)`` on the tiny GPT, ``nodes`` x ``rpn``
    ranks (with the cluster and workload they came from)."""
    from zeropp.runtime import ZeroConfig

    w = Workload.from_zero(ZeroConfig(**kw), units=TINY_UNITS, compute_s=0.0, tokens_per_rank=1)
    c = Cluster(nodes=nodes, ranks_per_node=rpn, cross_gbps=1.0, nics_per_node=1)
    return pairwise_bytes(messages(w, c)), c, w
