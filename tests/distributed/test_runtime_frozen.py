"""Frozen parameters at every stage, sharded at stage 3, and MixZ++ (``quantize_frozen``).

- parity: a LoRA GPT (base frozen, adapters trained) and a GPT with frozen parts (the position
  embedding and the whole block 1: a block with frozen parameters only) trained by ZeroEngine at
  stages 0-3 (stage 3 also with hpZ and a prefetch depth of 2, with activation checkpointing, and with
  both and the root and the last block kept gathered into backward) on a 2x2 gloo world in fp32 match
  single-process training on the global batch, to the tolerance of ``test_runtime_parity``;
- stage 3 really shards them: per rank ``ceil(numel / W)`` elements per frozen unit, and the
  frozen gathers' bytes follow the formula (twice per unit per micro-step, ``B * (W - 1)`` each);
- ``quantize_frozen=int8|int4``: the forward equals a reference model whose frozen weights are
  ``dequantize(quantize(shard))`` of each rank's shard, exactly; the per-rank bytes are the wire
  rows'; exports and checkpoints return those dequantized values (exact originals without it);
- MixZ++ with hpZ: INT8 frozen gathers stay inside the node after the first forward, same losses;
- ``offload_param=cpu|nvme`` moves the frozen shards too, with identical losses;
- bad input: ``quantize_frozen`` at stages 0-2 or an unknown value.

Here: the gloo-world checks of this topic; its other tiers' checks are in
``tests/unit/test_runtime_frozen.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tests.runtime_helpers import TINY, micro_batch, rank_batches, reference_train, rel_err
from tests.worlds import run_world
from zeropp.models import GPT

STEPS, ACCUM, CLIP, LR, WD = 3, 2, 0.5, 1e-3, 0.01
LORA = TINY.with_(lora_rank=4)
MODELS = ("lora", "partial")
CONFIGS = [dict(stage=s) for s in (0, 1, 2, 3)] + [
    dict(stage=3, hpz=True, prefetch_depth=2),
    dict(stage=3, prefetch_depth=0, checkpointing=True),
    dict(
        stage=3, hpz=True, prefetch_depth=0, checkpointing=True, keep_at_turn=True
    ),  # "partial": block 1 kept, frozen only
]


def build(name: str) -> GPT:
    torch.manual_seed(0)
    if name == "lora":
        return GPT(LORA)
    m = GPT(TINY)
    m.pos_emb.weight.requires_grad_(False)
    for p in m.blocks[1].parameters():  # block 1: frozen parameters only
        p.requires_grad_(False)
    return m


def reference(name: str, world: int) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    return reference_train(STEPS, world, ACCUM, lr=LR, wd=WD, clip=CLIP, model=build(name))


def _parity_world(rank: int, world: int) -> dict[Any, Any]:
    from zeropp.comm import Topology
    from zeropp.runtime import OptimizerConfig, ZeroConfig, ZeroEngine

    out: dict[Any, Any] = {}
    for name in MODELS:
        for k, kw in enumerate(CONFIGS):
            zkw = {a: v for a, v in kw.items() if a != "checkpointing"}
            eng = ZeroEngine(
                build(name),
                config=ZeroConfig(grad_accum_steps=ACCUM, grad_clip=CLIP, **zkw),
                activation_checkpointing=kw.get("checkpointing", False),
                optimizer=OptimizerConfig(lr=LR, weight_decay=WD),
                topology=Topology(nodes=2, ranks_per_node=2),
            )
            try:
                res = [eng.train_step(rank_batches(s, ACCUM, rank)) for s in range(STEPS)]
                out[name, k] = {
                    "losses": [r.loss for r in res],
                    "norms": [r.grad_norm for r in res],
                    "weights": {n: v.numpy() for n, v in eng.consolidated_state_dict().items()},
                    "frozen": {u.name: u.numel for u in eng.frozen_units},
                    "trained": sum(u.numel for u in eng.units),
                    "pool": eng.buffers.allocations,
                }
                eng.train_step(rank_batches(STEPS, ACCUM, rank))
                out[name, k]["pool_after"] = eng.buffers.allocations  # constant once the pattern repeats
            finally:
                eng.close()
    return out if rank == 0 else {k: {"losses": v["losses"]} for k, v in out.items()}


def test_frozen_and_lora_match_single_process_at_every_stage_2x2(worlds: dict[str, list[Any]]) -> None:
    world = 4
    res = worlds["parity"]
    for name in MODELS:
        ref_losses, ref_norms, ref_w = reference(name, world)
        model = build(name)
        n_trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        n_frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
        assert n_frozen > 0 and n_trained > 0
        for k, kw in enumerate(CONFIGS):
            r = res[0][name, k]
            for other in res[1:]:
                assert other[name, k]["losses"] == r["losses"]
            for a, b in zip(r["losses"], ref_losses):
                assert abs(a - b) <= 1e-5 * abs(b), (name, kw, r["losses"], ref_losses)
            for a, b in zip(r["norms"], ref_norms):
                assert abs(a - b) <= 1e-5 * abs(b), (name, kw, r["norms"], ref_norms)
            w = r["weights"]
            assert set(w) == set(ref_w), (name, kw)
            flat_got = torch.cat([torch.as_tensor(w[n]).reshape(-1) for n in ref_w])
            flat_ref = torch.cat([ref_w[n].reshape(-1) for n in ref_w])
            assert rel_err(flat_got, flat_ref) <= 1e-5, (name, kw)
            for n, p in model.named_parameters():  # frozen weights come back exactly
                if not p.requires_grad:
                    assert np.array_equal(w[n], ref_w[n].numpy()), (name, kw, n)
            assert r["trained"] == n_trained, (name, kw)
            if kw["stage"] == 3:  # every frozen parameter in one frozen unit, none left replicated
                assert sum(r["frozen"].values()) == n_frozen, (name, kw, r["frozen"])
            else:
                assert r["frozen"] == {}
            assert r["pool_after"] == r["pool"], (name, kw)
    assert set(res[0]["partial", 3]["frozen"]) == {"root.frozen", "block1.frozen"}  # block 1: frozen only
    assert set(res[0]["lora", 3]["frozen"]) == {"root.frozen", "block0.frozen", "block1.frozen"}


# ---------------------------------------------------------------------- sharding, MixZ++, bytes
W2 = 2


def _reference_frozen(layout_units: list, model: GPT, bits: int | None, world: int) -> dict[str, torch.Tensor]:
    """Per frozen unit: the full values every rank computes with (fp32): the originals, or each
    rank's padded shard through ``dequantize(quantize(shard))`` with the kernels directly."""
    from zeropp.kernels import DEFAULT_WEIGHT_GROUP_SIZE, dequantize, quantize
    from zeropp.runtime.partition import unflatten

    named = dict(model.named_parameters())
    out: dict[str, torch.Tensor] = {}
    for lay in layout_units:
        full = torch.zeros(lay.padded)
        for s in lay.slots:
            full[s.offset : s.offset + s.numel] = named[s.name].detach().reshape(-1)
        if bits is not None:
            S = lay.shard_numel
            full = torch.cat(
                [
                    dequantize(quantize(full[r * S : (r + 1) * S].clone(), bits, DEFAULT_WEIGHT_GROUP_SIZE)).reshape(-1)
                    for r in range(world)
                ]
            )
        out.update({k: v.clone() for k, v in unflatten(lay, full).items()})
    return out


def _mixz_world(rank: int, world: int, path: str) -> dict[str, Any]:
    from zeropp.comm import Topology
    from zeropp.comm.codecs import wire_layout
    from zeropp.kernels import DEFAULT_WEIGHT_GROUP_SIZE
    from zeropp.runtime import OptimizerConfig, ZeroConfig, ZeroEngine
    from zeropp.runtime import frozen as fz

    out: dict[str, Any] = {}
    idx, tgt = micro_batch(0, 0, 0)
    for q, bits in (("none", None), ("int8", 8), ("int4", 4)):
        eng = ZeroEngine(
            build("lora"),
            config=ZeroConfig(stage=3, quantize_frozen=q),
            optimizer=OptimizerConfig(lr=LR, weight_decay=WD),
            topology=Topology(nodes=world, ranks_per_node=1),
        )
        try:
            lays = [u.layout for u in eng.frozen_units]
            ref = build("lora")
            values = _reference_frozen(lays, ref, bits, world)
            with torch.no_grad():
                for n, p in ref.named_parameters():
                    if n in values:
                        p.copy_(values[n])
                ref_logits = ref(idx)[0]
                got = eng.model(idx)[0]  # stage-3 hooks gather (dequantize) the frozen units
            eng.stage3.release_all()
            per_unit = []
            for u in eng.frozen_units:
                b = (
                    u.shard_numel * 4
                    if bits is None
                    else wire_layout(u.shard_numel, bits, DEFAULT_WEIGHT_GROUP_SIZE).nbytes
                )
                per_unit.append((u.numel, u.shard_numel, b, fz.held_bytes(u)))
            mem0 = eng.memory_report()["params"]
            eng.comm_stats.reset()
            eng.train_step([(idx, tgt)])
            sd = eng.consolidated_state_dict()
            out[q] = {
                "logits_equal": torch.equal(got, ref_logits),
                "per_unit": per_unit,
                "mem_params": mem0,
                "trained_shards": sum(u.shard_numel * 4 for u in eng.units),
                "frozen_bytes": fz.frozen_bytes(eng.frozen),
                "stats": eng.comm_stats.snapshot().get(fz.KIND, {}),
                "calls": eng.comm_stats.calls().get(fz.KIND),
                "export_equal": all(torch.equal(sd[n], values[n]) for n in values),
                "phases": eng.memory_phases()["model_creation"].tiers["device"]["params"],
            }
            if q == "int8":  # checkpoint: saved dequantized, loaded (and re-quantized once) into a new engine
                eng.save_checkpoint(path)
                torch.manual_seed(5)
                other = ZeroEngine(
                    GPT(LORA),
                    config=ZeroConfig(stage=3, quantize_frozen=q),
                    optimizer=OptimizerConfig(lr=LR),
                    topology=Topology(nodes=world, ranks_per_node=1),
                )
                other.load_checkpoint(path)
                sd2 = other.consolidated_state_dict()
                with torch.no_grad():
                    out["ckpt_logits_equal"] = torch.equal(other.model(idx)[0], eng.model(idx)[0])
                other.stage3.release_all()
                eng.stage3.release_all()
                out["ckpt_export_equal"] = all(torch.equal(sd2[n], sd[n]) for n in values)
                other.close()
                one = ZeroEngine(
                    GPT(LORA), config=ZeroConfig(stage=1), topology=Topology(nodes=world, ranks_per_node=1)
                )
                one.load_checkpoint(path)  # stage 1: frozen replicated, loaded whole
                sd1 = one.consolidated_state_dict()
                out["ckpt_stage1_equal"] = all(torch.equal(sd1[n], sd[n]) for n in values)
                one.close()
        finally:
            eng.close()
    return out


def test_stage3_frozen_shards_quantized_once_exact_forward_and_bytes(worlds: dict[str, list[Any]]) -> None:
    res = worlds["mixz"]
    for r in res:
        for q in ("none", "int8", "int4"):
            d = r[q]
            assert d["logits_equal"], q  # == reference with dequantize(quantize(shard)) frozen weights
            assert d["export_equal"], q  # exports: originals (none) or the dequantized values
            for numel, shard, b, held in d["per_unit"]:
                assert shard == -(-numel // W2)  # really sharded: ceil(numel / W) per rank
                assert held == b, (q, held, b)  # the stored shard: compute dtype or the wire row
            assert d["frozen_bytes"] == sum(b for *_, b in d["per_unit"])
            assert d["mem_params"] == d["trained_shards"] + d["frozen_bytes"]
            assert d["phases"] == d["mem_params"]
            # one step, one micro-batch: every frozen unit gathered in forward and in backward,
            # each gather sending the stored row to the other rank (a different node: cross)
            n_units = len(d["per_unit"])
            assert d["calls"] == 2 * n_units, q
            assert d["stats"] == {"intra": 0, "cross": 2 * sum(b for *_, b in d["per_unit"]) * (W2 - 1)}, (
                q,
                d["stats"],
            )
        full = r["none"]["frozen_bytes"]
        assert r["int8"]["frozen_bytes"] <= 0.55 * full and r["int4"]["frozen_bytes"] <= 0.3 * full
        assert r["ckpt_logits_equal"] and r["ckpt_export_equal"] and r["ckpt_stage1_equal"]


def _mixz_hpz_world(rank: int, world: int, path: str) -> dict[str, Any]:
    """2x2, stage 3, LoRA GPT with INT8 frozen weights, with and without hpZ: losses, frozen-gather
    bytes of step 1 and of steps 2.., and the frozen units' secondary copies."""
    from zeropp.comm import Topology
    from zeropp.runtime import OptimizerConfig, ZeroConfig, ZeroEngine
    from zeropp.runtime import frozen as fz

    out: dict[str, Any] = {}
    for hpz in (False, True):
        eng = ZeroEngine(
            build("lora"),
            config=ZeroConfig(stage=3, quantize_frozen="int8", hpz=hpz, grad_accum_steps=ACCUM),
            optimizer=OptimizerConfig(lr=LR, weight_decay=WD),
            topology=Topology(nodes=2, ranks_per_node=2),
        )
        try:
            losses = [eng.train_step(rank_batches(0, ACCUM, rank)).loss]
            first = eng.comm_stats.snapshot().get(fz.KIND)
            eng.comm_stats.reset()
            losses += [eng.train_step(rank_batches(s, ACCUM, rank)).loss for s in range(1, STEPS)]
            out[hpz] = {
                "losses": losses,
                "first": first,
                "later": eng.comm_stats.snapshot().get(fz.KIND),
                "secondary": [
                    (
                        None if u.secondary is None else (str(u.secondary.dtype), u.secondary.numel()),
                        u.extra["wire"].numel(),
                    )
                    for u in eng.frozen_units
                ],
            }
            if hpz:  # a load re-quantizes the frozen shards: their secondary copies are dropped
                eng.save_checkpoint(path)
                eng.load_checkpoint(path)
                out["after_load"] = [u.secondary for u in eng.frozen_units]
        finally:
            eng.close()
    return out


def test_mixz_with_hpz_keeps_frozen_gathers_inside_the_node(worlds: dict[str, list[Any]]) -> None:
    """MixZ++ with hpZ: the first forward gathers each INT8 frozen unit over the world and keeps
    this rank's slice of the quantized rows; every later gather stays inside the node, with the
    same values (losses identical to the run without hpZ, which gathers across nodes every time)."""
    res = worlds["mixz_hpz"]
    for r in res:
        plain, hier = r[False], r[True]
        assert hier["losses"] == plain["losses"]  # the same dequantized rows, from the node instead of the world
        assert plain["later"]["cross"] > 0 and hier["later"]["cross"] == 0 and hier["later"]["intra"] > 0
        # step 1 without hpZ: forward + backward gather per unit per micro-batch; with hpZ one world gather
        assert hier["first"]["cross"] * 2 * ACCUM == plain["first"]["cross"], (hier["first"], plain["first"])
        for sec, wire in hier["secondary"]:
            assert sec == ("torch.uint8", 2 * wire)  # W / h = 2 ranks' quantized rows, kept quantized
        assert all(sec is None for sec, _ in plain["secondary"])
        assert r["after_load"] == [None] * len(hier["secondary"])


def _offload_world(rank: int, world: int, path: str) -> dict[str, Any]:
    """Stage 3, LoRA GPT, frozen weights in fp32 or INT8, kept on the device / in host memory / on
    nvme (``offload_param``): losses, exported weights, memory by tier, and a checkpoint round trip."""
    from zeropp.comm import Topology
    from zeropp.runtime import OptimizerConfig, ZeroConfig, ZeroEngine
    from zeropp.runtime import frozen as fz

    out: dict[str, Any] = {}
    for q in ("none", "int8"):
        for tier in ("none", "cpu", "nvme"):
            nvme = f"{path}-swap-{q}-{tier}" if tier == "nvme" else None
            if nvme:
                import os

                os.makedirs(nvme, exist_ok=True)
            zc = ZeroConfig(stage=3, quantize_frozen=q, offload_param=tier, nvme_path=nvme, grad_accum_steps=ACCUM)
            eng = ZeroEngine(
                build("lora"),
                config=zc,
                optimizer=OptimizerConfig(lr=LR, weight_decay=WD),
                topology=Topology(nodes=world, ranks_per_node=1),
            )
            try:
                tiers = eng.memory_phases()["model_creation"].tiers
                r = {
                    "losses": [eng.train_step(rank_batches(s, ACCUM, rank)).loss for s in range(STEPS)],
                    "weights": {n: v.numpy() for n, v in eng.consolidated_state_dict().items()},
                    "frozen_bytes": fz.frozen_bytes(eng.frozen),
                    "trained_shards": sum(u.shard_numel * 4 for u in eng.units),
                    "params": {t: tiers[t]["params"] for t in ("device", "host", "disk")},
                    "held": [fz.held(u) is None for u in eng.frozen_units],
                }
                eng.save_checkpoint(f"{path}-{q}-{tier}")
                eng.load_checkpoint(f"{path}-{q}-{tier}")  # re-stored into the tier
                r["reloaded"] = {n: v.numpy() for n, v in eng.consolidated_state_dict().items()}
                r["after_load"] = eng.train_step(rank_batches(STEPS, ACCUM, rank)).loss
                out[q, tier] = r
            finally:
                eng.close()
    return out


def test_frozen_shards_offload_to_host_and_nvme(worlds: dict[str, list[Any]]) -> None:
    """``offload_param=cpu|nvme`` moves the frozen shards (fp32, or MixZ++'s INT8 rows) off the
    device with the trainable ones: the same losses and weights as on the device, bit for bit, the
    bytes on the host / disk tier, and a checkpoint load writes them back to that tier."""
    res = worlds["offload"]
    for r in res:
        for q in ("none", "int8"):
            base = r[q, "none"]
            for tier in ("cpu", "nvme"):
                d = r[q, tier]
                assert d["losses"] == base["losses"], (q, tier)
                assert _same(d["weights"], base["weights"]) and _same(d["reloaded"], base["weights"]), (q, tier)
                assert d["after_load"] == base["after_load"], (q, tier)
                moved = base["params"]["device"] - d["params"]["device"]
                assert moved == d["trained_shards"] + d["frozen_bytes"], (q, tier, d["params"], base["params"])
            assert r[q, "cpu"]["params"]["host"] == moved
            disk = r[q, "nvme"]["params"]["disk"]  # the swap file: each frozen region 64-byte aligned
            assert moved <= disk < moved + 64 * len(r[q, "nvme"]["held"]), (disk, moved)
            assert all(r[q, "nvme"]["held"]) and not any(r[q, "cpu"]["held"])  # nvme: nothing held in memory
        assert r["int8", "none"]["frozen_bytes"] < 0.3 * r["none", "none"]["frozen_bytes"]  # fp32 -> INT8 rows


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def _four_ranks(rank: int, world: int, path: str) -> dict[str, Any]:
    return {"parity": _parity_world(rank, world), "mixz_hpz": _mixz_hpz_world(rank, world, path)}


def _two_ranks(rank: int, world: int, mixz_path: str, offload_path: str) -> dict[str, Any]:
    return {"mixz": _mixz_world(rank, world, mixz_path), "offload": _offload_world(rank, world, offload_path)}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    """The four checks' worlds as two launches, one of 4 ranks (parity, MixZ++ with hpZ) and one of
    ``W2`` (MixZ++, offload), each check in its own folder: results by check, then rank (a world
    start costs seconds of interpreter and torch start-up per rank)."""
    root = tmp_path_factory.mktemp("frozen")
    dirs = {name: root / name for name in ("mixz_hpz", "mixz", "offload")}
    for d in dirs.values():
        d.mkdir()
    four = run_world(_four_ranks, 4, str(dirs["mixz_hpz"] / "ckpt"), timeout=700)
    two = run_world(_two_ranks, W2, str(dirs["mixz"] / "ckpt"), str(dirs["offload"] / "ckpt"), timeout=700)
    return {name: [r[name] for r in res] for res in (four, two) for name in res[0]}
