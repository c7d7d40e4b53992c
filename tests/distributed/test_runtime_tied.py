"""Tied (shared) parameters at every stage: one shard, one gradient, counted once.

Three models, each trained by ZeroEngine at stages 0-3 on a 2x2 gloo world in fp32 and compared
with single-process training on the global batch (``torch.optim.AdamW`` + ``clip_grad_norm_``), to
the tolerance of ``test_runtime_parity``:

- ``tied``: the GPT with ``tie_embeddings=True`` (its default): ``head.weight`` *is*
  ``tok_emb.weight``, both in the root unit;
- ``untied``: the same GPT with its own head weight;
- ``shared_blocks``: ALBERT-style, block 1's MLP input layer is block 0's (one module registered in
  two blocks): the engine keeps those parameters in the root unit, so stage 3 works too.

Then: a checkpoint of a tied model saved at stage 3 on 2 ranks resumes exactly at stage 1, and
its ``export_consolidated`` file loads (strictly) into the unwrapped, tied GPT.

Here: the gloo-world checks of this topic; its other tiers' checks are in ``tests/unit/test_runtime_tied.py``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from tests.runtime_helpers import TINY, rank_batches, reference_train, rel_err
from tests.worlds import run_world
from zeropp.models import GPT

STEPS, ACCUM, CLIP, LR, WD = 6, 2, 0.5, 1e-3, 0.01
STAGES = (0, 1, 2, 3)
MODELS = ("tied", "untied", "shared_blocks")


def build(name: str) -> GPT:
    torch.manual_seed(0)
    if name == "untied":
        return GPT(TINY.with_(tie_embeddings=False))
    m = GPT(TINY)
    if name == "shared_blocks":
        m.blocks[1].fc = m.blocks[0].fc  # [4D, D] weight and [4D] bias, registered in both blocks
    return m


def reference(name: str, world: int) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    return reference_train(STEPS, world, ACCUM, lr=LR, wd=WD, clip=CLIP, model=build(name))


def _tied_world(rank: int, world: int) -> dict[str, Any]:
    from zeropp.comm import Topology
    from zeropp.runtime import OptimizerConfig, ZeroConfig, ZeroEngine

    out: dict[str, Any] = {}
    for name in MODELS:
        for stage in STAGES:
            model = build(name)
            eng = ZeroEngine(
                model,
                config=ZeroConfig(stage=stage, grad_accum_steps=ACCUM, grad_clip=CLIP),
                optimizer=OptimizerConfig(lr=LR, weight_decay=WD),
                topology=Topology(nodes=2, ranks_per_node=2),
            )
            try:
                res = [eng.train_step(rank_batches(s, ACCUM, rank)) for s in range(STEPS)]
                slots = {s.name: s.aliases for u in eng.units for s in u.slots}
                out[name, stage] = {
                    "losses": [r.loss for r in res],
                    "norms": [r.grad_norm for r in res],
                    "weights": {k: v.numpy() for k, v in eng.consolidated_state_dict().items()},
                    "num_params": eng.num_params,
                    "slots": slots,
                    "units": {u.name: u.numel for u in eng.units},
                    "still_tied": model.head.weight is model.tok_emb.weight,
                }
            finally:
                eng.close()
    return out if rank == 0 else {k: {"losses": v["losses"]} for k, v in out.items()}


def test_tied_weights_match_single_process_at_every_stage_2x2() -> None:
    world = 4
    res = run_world(_tied_world, world, timeout=300)
    for name in MODELS:
        ref_losses, ref_norms, ref_w = reference(name, world)
        assert max(ref_norms) > CLIP, "the test must exercise clipping"
        n_ref = sum(p.numel() for p in build(name).parameters())  # a shared parameter counted once
        for stage in STAGES:
            r = res[0][name, stage]
            for other in res[1:]:
                assert other[name, stage]["losses"] == r["losses"]
            for a, b in zip(r["losses"], ref_losses):
                assert abs(a - b) <= 1e-5 * abs(b), (name, stage, r["losses"], ref_losses)
            for a, b in zip(r["norms"], ref_norms):
                assert abs(a - b) <= 1e-5 * abs(b), (name, stage, r["norms"], ref_norms)
            w = r["weights"]
            assert set(w) == set(ref_w), (name, stage)  # every name of a tied weight, as state_dict
            flat_got = torch.cat([torch.as_tensor(w[k]).reshape(-1) for k in ref_w])
            flat_ref = torch.cat([ref_w[k].reshape(-1) for k in ref_w])
            assert rel_err(flat_got, flat_ref) <= 1e-5, (name, stage)
            assert max(rel_err(w[k], ref_w[k]) for k in ref_w) <= 2e-4, (name, stage)
            # one shard, one optimizer state: every unit together holds each parameter once
            assert r["num_params"] == n_ref == sum(r["units"].values()), (name, stage)
            assert r["still_tied"] is (name != "untied")
            if name == "tied":
                assert r["slots"]["tok_emb.weight"] == ("head.weight",) and "head.weight" not in r["slots"]
                assert np.array_equal(w["head.weight"], w["tok_emb.weight"])
            if name == "shared_blocks":
                assert r["slots"]["blocks.0.fc.weight"] == ("blocks.1.fc.weight",)
                assert np.array_equal(w["blocks.1.fc.bias"], w["blocks.0.fc.bias"])
    # the tied model has a [V, D] matrix fewer than the untied one, in the engine as in the config
    assert res[0]["untied", 3]["num_params"] - res[0]["tied", 3]["num_params"] == TINY.vocab_size * TINY.d_model
    assert TINY.num_params() == res[0]["tied", 0]["num_params"]


SPLIT = 3


def _ckpt_world(rank: int, world: int, path: str, out_file: str) -> dict[str, Any]:
    from zeropp.comm import Topology
    from zeropp.runtime import OptimizerConfig, ZeroConfig, ZeroEngine, export_consolidated

    def engine(stage: int, seed: int) -> ZeroEngine:
        torch.manual_seed(seed)
        return ZeroEngine(
            GPT(TINY),
            config=ZeroConfig(stage=stage, grad_accum_steps=ACCUM, grad_clip=CLIP),
            optimizer=OptimizerConfig(lr=LR, weight_decay=WD),
            topology=Topology.single_node(world),
        )

    a = engine(3, seed=0)
    ref = [a.train_step(rank_batches(s, ACCUM, rank)).loss for s in range(SPLIT)]
    a.save_checkpoint(path, extra={"step": SPLIT})
    sd = {k: v.numpy() for k, v in a.consolidated_state_dict().items()}
    ref += [a.train_step(rank_batches(s, ACCUM, rank)).loss for s in range(SPLIT, 2 * SPLIT)]
    a.close()
    b = engine(1, seed=7)  # other initial weights: everything must come from the checkpoint
    extra = b.load_checkpoint(path)
    after = {k: v.numpy() for k, v in b.consolidated_state_dict().items()}
    resumed = [b.train_step(rank_batches(s, ACCUM, rank)).loss for s in range(SPLIT, 2 * SPLIT)]
    b.close()
    exported = None
    if rank == 0:
        export_consolidated(path, out_file)
        plain = GPT(TINY)
        plain.load_state_dict(torch.load(out_file))  # strict: both names of the tied weight are there
        assert plain.head.weight is plain.tok_emb.weight
        exported = {k: v.detach().numpy() for k, v in plain.state_dict().items()}
    return {"ref": ref, "resumed": resumed, "extra": extra, "saved": sd, "loaded": after, "exported": exported}


def test_tied_checkpoint_resumes_at_another_stage_and_exports(tmp_path) -> None:
    res = run_world(_ckpt_world, 2, str(tmp_path / "ck"), str(tmp_path / "model.pt"), timeout=150)
    for r in res:
        assert r["extra"] == {"step": SPLIT}
        assert set(r["saved"]) == set(r["loaded"]) and "head.weight" in r["saved"]
        for k in r["saved"]:
            assert np.array_equal(r["saved"][k], r["loaded"][k]), k
        for a, b in zip(r["resumed"], r["ref"][SPLIT:]):
            assert math.isclose(a, b, rel_tol=1e-6), (r["resumed"], r["ref"])
    exported = res[0]["exported"]
    for k, v in res[0]["saved"].items():
        assert np.array_equal(exported[k], v), k
