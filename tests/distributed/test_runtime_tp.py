"""ZeRO with tensor parallelism (``Topology(tp=2)``): exact against one unsplit process in fp32.

A world of ``nodes x ranks_per_node`` gloo ranks is a ``("dp", "tp")`` mesh: every 2 consecutive
ranks split each block's heads and MLP (torch's TP plans), ZeRO shards over the ranks sharing a tp
index. Tensor-parallel ranks see the same micro-batch (that of their data-parallel index), so the
reference trains the unsplit model on the dp ranks' batches concatenated (``reference``), with
``torch.optim.AdamW`` and ``clip_grad_norm_`` over the whole model: losses, gradient norms (the
norm sums split weights over tp and counts replicated ones once) and the full weights
(``consolidated_state_dict`` all-gathers over dp and tp) are compared within the tolerances of
``test_runtime_parity``. Worlds of 8 ranks are slow on a small CPU, so there are few of them.

Here: the gloo-world checks of this topic; its other tiers' checks are in ``tests/unit/test_runtime_tp.py``.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

from tests.runtime_helpers import TINY, micro_batch, reference_train, rel_err
from tests.worlds import run_world
from zeropp.comm import QuantSpec
from zeropp.models import GPT

STEPS, ACCUM, CLIP, LR, WD = 4, 2, 0.5, 1e-3, 0.01
BASE = dict(grad_accum_steps=ACCUM, grad_clip=CLIP)
CFG = TINY  # d_model 32, 2 heads, MLP 128: tp=2 splits one head per rank
LLAMA = dict(
    hf_config="llama", vocab_size=256, seq_len=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64
)


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt":
        return GPT(CFG)
    from zeropp.models.hf import HFConfig, build_hf_model

    return build_hf_model(HFConfig(**LLAMA), seed=0)


def reference(kind: str, dp: int, steps: int = STEPS) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """Single-process training on the dp ranks' micro-batches concatenated."""
    return reference_train(steps, dp, ACCUM, lr=LR, wd=WD, clip=CLIP, cfg=CFG, model=_model(kind))


def _tp_world(
    rank: int, world: int, nodes: int, configs: list[dict[str, Any]], kind: str, steps: int = STEPS
) -> list[dict[str, Any]]:
    from zeropp.comm import Topology
    from zeropp.runtime import OptimizerConfig, ZeroConfig, ZeroEngine
    from zeropp.runtime.tensor_parallel import make_mesh, parallelize

    topo = Topology(nodes=nodes, ranks_per_node=world // nodes, tp=2)
    mesh = make_mesh(topo)
    dp = topo.dp_index(rank)
    out = []
    for kw in configs:
        kw = dict(kw)
        ac = kw.pop("activation_checkpointing", False)  # an engine argument, not a ZeroConfig field
        zc = ZeroConfig(**kw)
        eng = ZeroEngine(
            parallelize(_model(kind), mesh),
            config=zc,
            optimizer=OptimizerConfig(lr=LR, weight_decay=WD),
            topology=topo,
            activation_checkpointing=ac,
        )
        try:
            res = [eng.train_step([micro_batch(s, j, dp, CFG) for j in range(ACCUM)]) for s in range(steps)]
            w = {k: v.numpy() for k, v in eng.consolidated_state_dict().items()}
            out.append(
                {
                    "losses": [r.loss for r in res],
                    "norms": [r.grad_norm for r in res],
                    "skipped": [r.skipped for r in res],
                    "weights": w if rank == 0 else None,
                    "cross": eng.comm_stats.snapshot(),
                }
            )
        finally:
            eng.close()
    return out


def _check(results: list, configs: list[dict[str, Any]], ref: tuple, *, exact: bool = True) -> None:
    ref_losses, ref_norms, ref_w = ref
    assert max(ref_norms) > CLIP, "the test must exercise clipping"
    for i, kw in enumerate(configs):
        r = results[0][i]
        for other in results[1:]:  # every rank reports the same global loss and norm
            assert other[i]["losses"] == r["losses"] and other[i]["norms"] == r["norms"], kw
        assert not any(r["skipped"]), kw
        if not exact:  # quantized: close to the reference, not equal
            for a, b in zip(r["losses"], ref_losses):
                assert abs(a - b) <= 2e-2 * abs(b), (kw, r["losses"], ref_losses)
            continue
        for a, b in zip(r["losses"], ref_losses):
            assert abs(a - b) <= 1e-5 * abs(b), (kw, r["losses"], ref_losses)
        for a, b in zip(r["norms"], ref_norms):
            assert abs(a - b) <= 1e-5 * abs(b), (kw, r["norms"], ref_norms)
        w = r["weights"]
        assert set(w) == set(ref_w), kw
        flat_got = torch.cat([torch.as_tensor(w[k]).reshape(-1) for k in ref_w])
        flat_ref = torch.cat([ref_w[k].reshape(-1) for k in ref_w])
        assert rel_err(flat_got, flat_ref) <= 1e-5, kw
        worst = max(rel_err(w[k], ref_w[k]) for k in ref_w)
        assert worst <= 2e-4, (kw, worst)


STAGES = [dict(BASE, stage=s) for s in (0, 1, 2, 3)]


def _zero_bytes(r: dict[str, Any], link: str) -> int:
    return sum(v[link] for v in r["cross"].values())


TP2_DP2 = STAGES + [
    dict(BASE, stage=3, prefetch_depth=0, reduce_bucket_size=300, allgather_bucket_size=500),
    dict(BASE, stage=3, activation_checkpointing=True, offload_activations=True),
]
QWZ_QGZ = [dict(BASE, stage=3), dict(BASE, stage=3, weights=QuantSpec(bits=8), grads=QuantSpec(bits=8))]
BAD = {"heads": "tp=4 must divide the GPT's attention heads", "unsplit": "the model is not split"}


def _world_2x2(rank: int, world: int, gpt: list[dict[str, Any]], llama: list[dict[str, Any]]) -> dict[str, Any]:
    """Everything the 2-node x 2-rank tests check, in one world (a world start costs seconds of
    interpreter and torch start-up per rank): the GPT and Llama trainings, then the bad inputs."""
    return {
        "gpt": _tp_world(rank, world, 2, gpt, "gpt"),
        "llama": _tp_world(rank, world, 2, llama, "llama") if llama else [],
        "bad": {case: _bad_world(rank, world, case) for case in BAD},
    }


@pytest.fixture(scope="module")
def world_2x2() -> list[dict[str, Any]]:
    llama = STAGES if importlib.util.find_spec("transformers") is not None else []
    return run_world(_world_2x2, 4, TP2_DP2 + QWZ_QGZ, llama, timeout=600)


def test_gpt_tp2_dp2_matches_single_process_at_every_stage(world_2x2) -> None:
    """2 nodes x 2 ranks, tp=2: each node is one TP group, ZeRO across the two nodes."""
    results = [r["gpt"][: len(TP2_DP2)] for r in world_2x2]
    _check(results, TP2_DP2, reference("gpt", 2))
    for rank_results in results:  # ZeRO talks to the other node's rank with the same tp index only
        for r in rank_results:
            assert _zero_bytes(r, "intra") == 0 and _zero_bytes(r, "cross") > 0, r["cross"]


def test_gpt_tp2_on_2x4_matches_single_process() -> None:
    """2 nodes x 4 ranks, tp=2: dp=4 (2 per node), so ZeRO's groups have intra- and cross-node
    members; hpZ's secondary partition is the node's dp ranks."""
    configs = [dict(BASE, stage=3), dict(BASE, stage=3, hpz=True), dict(BASE, stage=2)]
    zeropp = [dict(BASE, stage=3, hpz=True, weights=QuantSpec(bits=8), grads=QuantSpec(bits=8))]
    results = run_world(_tp_world, 8, 2, configs + zeropp, "gpt", timeout=400)
    ref = reference("gpt", 4)
    _check([r[:3] for r in results], configs, ref)
    _check([r[3:] for r in results], zeropp, ref, exact=False)
    # qgZ over the dp ranks is hierarchical: hop 1 sends the node's 2 chunks to the one dp peer in
    # the node, hop 2 one partial sum across (a single hop would send 1 chunk inside, 2 across)
    for rank_results in results:
        rs = rank_results[3]["cross"]["grad_reduce_scatter"]
        assert rs["cross"] > 0 and rs["intra"] == 2 * rs["cross"], rs


def test_gpt_tp2_with_qwz_qgz_is_close(world_2x2) -> None:
    results = [r["gpt"][len(TP2_DP2) :] for r in world_2x2]
    ref = reference("gpt", 2)
    _check(results, QWZ_QGZ[:1], ref)
    _check([r[1:] for r in results], QWZ_QGZ[1:], ref, exact=False)
    plain, quant = results[0]  # qwZ + qgZ in int8 over dp: about a quarter of the fp32 cross-node bytes
    assert _zero_bytes(quant, "cross") < 0.35 * _zero_bytes(plain, "cross"), (plain["cross"], quant["cross"])


def test_llama_tp2_matches_single_process(world_2x2) -> None:
    pytest.importorskip("transformers", reason='the hf extra is not installed (pip install -e ".[hf]")')
    _check([r["llama"] for r in world_2x2], STAGES, reference("llama", 2))


# ---------------------------------------------------------------------------- checkpoints
N_CKPT, K_CKPT = 4, 2


def _tp_engine(topo, stage: int, seed: int):
    """A GPT split over tp, stage 3 with INT8 weights and hpZ or stage 1; ``seed`` picks its weights."""
    from zeropp.comm import QuantSpec
    from zeropp.runtime import OptimizerConfig, ZeroConfig, ZeroEngine
    from zeropp.runtime.tensor_parallel import make_mesh, parallelize

    torch.manual_seed(seed)
    model = GPT(CFG)
    zc = ZeroConfig(
        stage=stage,
        grad_accum_steps=ACCUM,
        grad_clip=CLIP,
        weights=QuantSpec(bits=8) if stage == 3 else None,
        hpz=stage == 3,
    )
    return ZeroEngine(
        parallelize(model, make_mesh(topo)), config=zc, optimizer=OptimizerConfig(lr=LR, weight_decay=WD), topology=topo
    )


def _train_tp(eng, topo, rank: int, steps) -> list[float]:
    dp = topo.dp_index(rank)
    return [eng.train_step([micro_batch(s, j, dp, CFG) for j in range(ACCUM)]).loss for s in steps]


def _weights(eng) -> dict:
    return {k: v.numpy() for k, v in eng.consolidated_state_dict().items()}


def _save_resume_world(rank: int, world: int, path: str) -> dict:
    """2x2, tp=2: N steps straight vs K steps, save, a fresh engine with other weights, load, N - K."""
    from zeropp.comm import Topology

    topo = Topology(nodes=2, ranks_per_node=2, tp=2)
    out: dict = {}
    for stage in (3, 1):
        ref = _tp_engine(topo, stage, 0)
        ref_losses = _train_tp(ref, topo, rank, range(N_CKPT))
        ref_w = _weights(ref)
        ref.close()
        a = _tp_engine(topo, stage, 0)
        first = _train_tp(a, topo, rank, range(K_CKPT))
        a.save_checkpoint(f"{path}-s{stage}", extra={"step": K_CKPT})
        saved_w = _weights(a)
        a.close()
        b = _tp_engine(topo, stage, 1)
        extra = b.load_checkpoint(f"{path}-s{stage}")
        rest = _train_tp(b, topo, rank, range(K_CKPT, N_CKPT))
        out[stage] = {
            "same_losses": first + rest == ref_losses,
            "losses": (first + rest, ref_losses),
            "extra": extra,
            "same_weights": _same_weights(_weights(b), ref_w),
            "saved": saved_w if rank == 0 else None,
        }
        b.close()
    return out


def _same_weights(a: dict, b: dict) -> bool:
    import numpy as np

    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def _reshard_world(rank: int, world: int, path: str, saved: dict) -> dict:
    """1 node x 2 ranks: the tp=2 checkpoint of a dp=2 run loads at dp=1 and trains; at tp=1 it is refused."""
    from zeropp.comm import Topology
    from zeropp.runtime import CheckpointError, ZeroConfig, ZeroEngine

    topo = Topology(nodes=1, ranks_per_node=2, tp=2)
    eng = _tp_engine(topo, 3, 1)
    eng.load_checkpoint(path)
    loaded = _same_weights(_weights(eng), saved)
    loss = _train_tp(eng, topo, rank, range(K_CKPT, K_CKPT + 1))[0]
    eng.close()
    plain = ZeroEngine(GPT(CFG), config=ZeroConfig(stage=3), topology=Topology(nodes=1, ranks_per_node=2))
    try:
        plain.load_checkpoint(path)
        refused = "no error"
    except CheckpointError as e:
        refused = str(e)
    finally:
        plain.close()
    return {"loaded": loaded, "loss": loss, "refused": refused}


def test_tp_checkpoint_resumes_exactly_reshards_over_dp_and_exports(tmp_path) -> None:
    """A tp=2 run saved after K steps and loaded into an engine built from other weights continues
    exactly as the uninterrupted run (stage 3 with qwZ + hpZ, and stage 1); the checkpoint loads at
    another data-parallel size, is refused at another tp, and exports to the unsplit model's weights."""
    from zeropp.runtime import export_consolidated

    path = str(tmp_path / "ckpt")
    results = run_world(_save_resume_world, 4, path, timeout=300)
    for stage in (3, 1):
        for r in results:
            assert r[stage]["same_losses"], (stage, r[stage]["losses"])
            assert r[stage]["same_weights"] and r[stage]["extra"] == {"step": K_CKPT}, stage
    saved = results[0][3]["saved"]
    exported = torch.load(export_consolidated(f"{path}-s3", tmp_path / "full.pt"))
    assert set(exported) == set(saved)
    assert all(torch.equal(exported[k], torch.as_tensor(saved[k])) for k in saved)
    GPT(CFG).load_state_dict(exported)  # strict: exactly the unsplit model's names and shapes
    resharded = run_world(_reshard_world, 2, f"{path}-s3", saved, timeout=200)
    for r in resharded:
        assert r["loaded"] and torch.isfinite(torch.tensor(r["loss"]))
        assert "was saved with topology.tp=2 and this run has tp=1" in r["refused"], r["refused"]


def _bad_world(rank: int, world: int, case: str) -> str:
    from zeropp.comm import Topology
    from zeropp.runtime import ZeroConfig, ZeroEngine
    from zeropp.runtime.tensor_parallel import make_mesh, parallelize

    topo = Topology(nodes=1, ranks_per_node=world, tp=2)
    try:
        if case == "heads":  # 2 heads cannot be split 4 ways: raised before any collective of the plan
            parallelize(GPT(CFG), make_mesh(Topology(nodes=1, ranks_per_node=world, tp=4)))
        elif case == "unsplit":
            ZeroEngine(GPT(CFG), config=ZeroConfig(stage=3), topology=topo)
    except (ValueError, NotImplementedError) as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_tp_input_raises_on_every_rank(world_2x2, case: str) -> None:
    errors = [r["bad"][case] for r in world_2x2]
    assert len(errors) == 4 and all(BAD[case] in e for e in errors), errors
