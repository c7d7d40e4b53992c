"""The communication plan (``zeropp.runtime.plan``) against the engine.

* its bytes per kind and link equal what the engine's ``CommStats`` records in a steady-state step,
  run as one rank of a fake world (``tests/plan_helpers.py``) for every quantization recipe at every
  stage, hpZ on and off, qWD, bucket chunking, accumulation, awkward topologies, MixZ++ (frozen
  units, stored quantized or not, with and without hpZ); tensor parallelism, whose DTensor plans
  do not run on the fake backend, is checked on a gloo world (``tests/distributed/test_scaling_bytes.py``);
* its kinds are the strings the code records, its bucketing is the engine's;
* its issue order and dependencies follow the engine's prefetch; it plans an 18.8B GPT from shapes
  on the meta device in well under a second.
"""

from __future__ import annotations

import inspect
import json
import time
from typing import Any

import pytest
import torch

from tests.plan_helpers import WORLDS, ZPP, steady_step_bytes
from tests.runtime_helpers import TINY
from zeropp.comm import Topology
from zeropp.comm.spec import RECIPES
from zeropp.models import GPT
from zeropp.runtime import ZeroConfig
from zeropp.runtime.plan import CommPlan, PlanUnit, build_plan, plan_units
from zeropp.runtime.plan_kinds import CommKind, Phase, chunk_ranges

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _lora() -> GPT:
    torch.manual_seed(0)
    return GPT(TINY.with_(lora_rank=4))


def _frozen() -> GPT:
    """pos_emb frozen in the root, block 1 frozen entirely (a unit with no trainable part)."""
    torch.manual_seed(0)
    m = GPT(TINY)
    m.pos_emb.weight.requires_grad_(False)
    for p in m.blocks[1].parameters():
        p.requires_grad_(False)
    return m


MIXZ = [dict(stage=3, quantize_frozen=q, hpz=hpz) for q in ("none", "int8", "int4") for hpz in (False, True)] + [
    dict(ZPP, quantize_frozen="int4", grad_accum_steps=2, allgather_bucket_size=1000),
    dict(
        stage=3,
        weights=RECIPES["sdp4bit"].weights,
        grads=RECIPES["sdp4bit"].grads,
        hpz=True,
        weight_diff=RECIPES["sdp4bit"].weight_diff,
        quantize_frozen="int8",
    ),
    dict(stage=2, grads=RECIPES["qgz"].grads),
    dict(stage=0),
    dict(stage=3, quantize_frozen="int8", keep_at_turn=True),  # ("frozen": the kept last block has no trainable part)
]

CASES: list[tuple[str, int, int, int, Any, dict[str, Any]]] = [
    ("gpt", world, nodes, 1, None, kw) for world, plans in WORLDS.items() for nodes, cfgs in plans for kw in cfgs
]
CASES += [(name, 4, 2, 1, fn, kw) for name, fn in (("lora", _lora), ("frozen", _frozen)) for kw in MIXZ]


def _id(case: tuple) -> str:
    name, world, nodes, tp, _, kw = case
    short = ",".join(f"{k}={getattr(v, 'bits', v)}" for k, v in kw.items())
    return f"{name}-{nodes}x{world // nodes}-tp{tp}-{short}"


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_plan_bytes_equal_engine_commstats(case: tuple) -> None:
    """Per kind and link, on the first and the last rank: the plan's bytes are the engine's."""
    _name, world, nodes, tp, model, kw = case
    for rank in (0, world - 1):
        units, measured = steady_step_bytes(
            kw, rank=rank, world=world, nodes=nodes, tp=tp, **({"model": model} if model else {})
        )
        plan = build_plan(units, ZeroConfig(**kw), Topology(nodes=nodes, ranks_per_node=world // nodes, tp=tp))
        assert plan.bytes_by_kind() == measured, f"rank {rank}"
        assert measured, "the step must communicate"


def test_mixz_cases_move_frozen_units() -> None:
    """The MixZ++ cases exercise frozen gathers: stored quantized and not, over the world and the node."""
    seen = set()
    for _name, world, nodes, _tp, model, kw in CASES:
        if model is not None and kw["stage"] == 3:
            plan = build_plan(
                plan_units(model()), ZeroConfig(**kw), Topology(nodes=nodes, ranks_per_node=world // nodes)
            )
            for c in plan.collectives:
                if c.kind == CommKind.FROZEN_ALL_GATHER:
                    seen.add((c.spec is not None and c.spec.bits, str(c.group)))
    assert {(8, "world"), (4, "world"), (8, "hpz"), (4, "hpz"), (False, "world"), (False, "hpz")} <= seen, seen


def test_kinds_are_the_strings_the_code_records() -> None:
    """CommKind's values are the kinds the modules record (so CommStats keys, summaries and wandb
    keys do not change), and a member formats and serializes as its string."""
    from zeropp.comm import ddp, fsdp
    from zeropp.comm.stats import PEER_BYTES_KINDS
    from zeropp.runtime import frozen, weight_diff

    assert CommKind(frozen.KIND) is CommKind.FROZEN_ALL_GATHER
    assert CommKind(weight_diff.KIND) is CommKind.WEIGHT_DIFF_ALL_GATHER
    assert {CommKind(k) for k in PEER_BYTES_KINDS} <= set(CommKind)
    assert CommKind(ddp.QuantizedAllReduceState.__dataclass_fields__["kind"].default) is CommKind.DDP_ALL_REDUCE
    assert (
        CommKind(inspect.signature(fsdp.QuantizedAllGather.__init__).parameters["kind"].default)
        is CommKind.FSDP_ALL_GATHER
    )
    assert (
        CommKind(inspect.signature(fsdp.QuantizedReduceScatter.__init__).parameters["kind"].default)
        is CommKind.FSDP_REDUCE_SCATTER
    )
    k = CommKind.FWD_ALL_GATHER
    assert k == "fwd_all_gather" and f"{k}.intra" == "fwd_all_gather.intra" and str(k) == "fwd_all_gather"
    assert json.dumps({k: 1}) == '{"fwd_all_gather": 1}' and {"fwd_all_gather": 1}[k] == 1


@pytest.mark.parametrize(
    "cols,rows,bucket",
    [
        (1, 1, 1),
        (1, 4, 1),
        (7, 1, 3),
        (7, 3, 20),
        (7, 3, 21),
        (17, 257, 257 * 5),
        (17, 257, 257 * 5 + 256),
        (17, 257, 100),
        (257, 17, 4369),
        (257, 17, 4368),
        (5, 4, 10**9),
        (0, 4, 10),
        (1000, 6, 3001),
    ],
)
def test_chunk_ranges_are_the_engines_and_the_models(cols: int, rows: int, bucket: int) -> None:
    """The one bucketing rule is the engine's (``runtime.collectives`` calls it) and equals the byte
    model's ``chunk_widths`` on awkward sizes, and its chunks tile the columns within the bucket."""
    from zeropp.experiments.projection.scaling import chunk_widths
    from zeropp.runtime import collectives

    got = chunk_ranges(cols, rows, bucket)
    assert collectives.chunk_ranges is chunk_ranges
    widths: dict[int, int] = {}
    for a, b in got:
        widths[b - a] = widths.get(b - a, 0) + 1
    assert chunk_widths(cols, rows, bucket) == widths
    assert got[0][0] == 0 and got[-1][1] == cols and all(x[1] == y[0] for x, y in zip(got, got[1:]))
    assert all((b - a) * rows <= bucket or b - a == 1 for a, b in got)


def test_chunk_ranges_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="bucket >= 1"):
        chunk_ranges(4, 2, 0)


def _plan(prefetch: int, **kw: Any) -> CommPlan:
    return build_plan(
        [100, 40, 40, 40], ZeroConfig(stage=3, prefetch_depth=prefetch, **kw), Topology(nodes=2, ranks_per_node=2)
    )


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_gathers_are_issued_prefetch_depth_blocks_ahead(prefetch: int) -> None:
    """Stage 3: block ``j``'s forward gather is issued before block ``j - p``'s compute and waited
    for by its own; a reduce-scatter is issued after its unit's backward; compute runs forward
    blocks, root, then backward root and blocks in reverse."""
    plan = _plan(prefetch)
    tasks = [(t.phase, t.unit) for t in plan.compute]
    assert tasks == [
        (Phase.FWD, 1),
        (Phase.FWD, 2),
        (Phase.FWD, 3),
        (Phase.FWD, 0),
        (Phase.BWD, 0),
        (Phase.BWD, 3),
        (Phase.BWD, 2),
        (Phase.BWD, 1),
        (Phase.POST, -1),
    ]
    fwd = [c for c in plan.collectives if c.kind == CommKind.FWD_ALL_GATHER]
    assert [c.unit for c in fwd] == [0, 1, 2, 3]
    for c in fwd[1:]:
        assert plan.compute[c.needed_by].unit == c.unit
        assert plan.compute[c.issued_before].unit == max(1, c.unit - prefetch)
    bwd = [c for c in plan.collectives if c.kind == CommKind.BWD_ALL_GATHER]
    assert [c.unit for c in bwd] == [0, 3, 2, 1]
    for c in plan.collectives:
        assert c.issued_before <= c.needed_by
        if c.kind == CommKind.GRAD_REDUCE_SCATTER:
            assert c.issued_before > tasks.index((Phase.BWD, c.unit))
    assert sum(c.kind == CommKind.CONTROL and not c.counted for c in plan.collectives) == 2


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_keep_at_turn_drops_the_backward_gathers_of_the_root_and_the_last_block(prefetch: int) -> None:
    """``keep_at_turn``: the same forward; in backward the root (unit 0) and the last block (3) are
    still gathered, so only blocks 2 and 1 are gathered, each still ``prefetch`` blocks ahead of
    its compute; the reduce-scatters are unchanged."""
    base, kept = _plan(prefetch), _plan(prefetch, keep_at_turn=True)
    assert kept.compute == base.compute

    def of(plan: CommPlan, kind: CommKind) -> list[tuple[int, int, int]]:
        return [(c.unit, c.issued_before, c.needed_by) for c in plan.collectives if c.kind == kind]

    for kind in (CommKind.FWD_ALL_GATHER, CommKind.GRAD_REDUCE_SCATTER):
        assert of(kept, kind) == of(base, kind)
    assert [u for u, _, _ in of(kept, CommKind.BWD_ALL_GATHER)] == [2, 1]
    assert [g for g in of(base, CommKind.BWD_ALL_GATHER) if g[0] in (2, 1)] == of(kept, CommKind.BWD_ALL_GATHER)
    # a last block without parameters is no engine unit: the block before it is the one kept
    empty_last = build_plan(
        [100, 40, 40, 0],
        ZeroConfig(stage=3, keep_at_turn=True, prefetch_depth=prefetch),
        Topology(nodes=2, ranks_per_node=2),
    )
    assert [c.unit for c in empty_last.collectives if c.kind == CommKind.BWD_ALL_GATHER] == [1]
    with pytest.raises(ValueError, match="keep_at_turn"):
        ZeroConfig(stage=2, keep_at_turn=True)


def test_plan_rejects_what_it_cannot_plan() -> None:
    with pytest.raises(ValueError, match="persistence_threshold"):
        build_plan([10, 10], ZeroConfig(stage=3, persistence_threshold=5), Topology(nodes=1, ranks_per_node=2))
    with pytest.raises(ValueError, match="no units"):
        build_plan([], ZeroConfig(), Topology(nodes=1, ranks_per_node=2))
    with pytest.raises(ValueError, match="counts >= 0"):
        PlanUnit(name="root", numel=-1)


def test_an_18b_gpt_is_planned_from_the_meta_device_in_well_under_a_second() -> None:
    """The paper's 18.8B GPT: its units from a meta-device model equal the closed form, and the
    plan of a ZeRO++ step on 48 nodes takes well under a second."""
    from zeropp.experiments.projection.scaling import gpt_units
    from zeropp.experiments.projection.speedup import paper_workload
    from zeropp.models import GPTConfig

    cfg = GPTConfig(vocab_size=50304, seq_len=2048, d_model=6144, n_layers=40, n_heads=48, tie_embeddings=False)
    with torch.device("meta"):
        units = plan_units(GPT(cfg))
    assert (
        tuple(u.numel for u in units)
        == paper_workload().units
        == gpt_units(vocab=50304, seq_len=2048, d_model=6144, n_layers=40, tie_embeddings=False)
    )
    t = time.perf_counter()
    plan = build_plan(
        units, ZeroConfig.from_recipe("zeropp", stage=3, precision="bf16"), Topology(nodes=48, ranks_per_node=8)
    )
    assert time.perf_counter() - t < 0.5
    assert len(plan.collectives) > 4 * len(units) and plan.total_bytes() > 0
