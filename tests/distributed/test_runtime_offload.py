"""ZeRO-Offload / ZeRO-Infinity against the in-memory engine, in one 2-node x 2-rank gloo world.

Reference: the in-memory run of the same switches (itself checked against single-process
torch training by test_runtime_parity.py). With ``cpu_adam="single"`` or ``"native-exact"`` the
offloaded step does the same arithmetic, so losses, gradient norms and weights must be
bit-identical; with torch's fused CPU AdamW or the ``native`` kernel (the default; a different rounding
of the same update, see ``offload.py``; ``native`` differs only where its IEEE square root does) the whole model's
weights must agree to ``FUSED_TOL`` (norm-relative, all weights as one vector) and the losses to
``FUSED_LOSS_TOL`` (relative). Single weights may differ more: a parameter whose true gradient is
zero (the key bias, by softmax invariance) gets rounding noise as gradient, and Adam turns any
noise into a step of about ``lr`` whose sign the rounding decides; so each weight is only bounded
by ``2 * LR * STEPS``.
Memory: fp32 model state per parameter at 4 ranks is 16 / 10 / 7 / 4 bytes for stages 0-3 (the
fp32 master is the parameter shard itself, no second copy), and each offload tier holds the ZeRO-Offload /
ZeRO-Infinity share of the state (within 5%).

Here: the gloo-world checks of this topic; its other tiers' checks are in
``tests/unit/test_runtime_offload.py``.
"""

from __future__ import annotations

import tempfile

import numpy as np
import pytest

from tests.runtime_helpers import make_model, rank_batches, rel_err
from tests.worlds import run_world
from zeropp.comm.spec import QuantSpec

STEPS, LR = 3, 1e-2
FUSED_TOL, FUSED_LOSS_TOL = 1e-5, 1e-6
W8, G8 = QuantSpec(bits=8), QuantSpec(bits=8)
F32 = dict(precision="fp32")
CPU = dict(offload_optimizer="cpu")
CPU3 = dict(offload_optimizer="cpu", offload_param="cpu")
NVME3 = dict(offload_optimizer="nvme", offload_param="nvme", swap_buffers=3, swap_buffer_size=1000)
# name -> (in-memory reference name, engine kwargs, cpu_adam)
RUNS = {
    "s1": (None, dict(F32, stage=1), "single"),
    "s2": (None, dict(F32, stage=2), "single"),
    "s3": (None, dict(F32, stage=3), "single"),
    "s1_cpu": ("s1", dict(F32, stage=1, **CPU), "single"),
    "s2_cpu": ("s2", dict(F32, stage=2, **CPU), "single"),
    "s3_cpu": ("s3", dict(F32, stage=3, **CPU3), "single"),
    "s3_cpu_opt_only": ("s3", dict(F32, stage=3, **CPU), "single"),
    "s2_nvme": ("s2", dict(F32, stage=2, offload_optimizer="nvme", swap_buffer_size=1000), "single"),
    "s3_nvme": ("s3", dict(F32, stage=3, **NVME3), "single"),
    "s3_nvme_param_cpu_opt": (
        "s3",
        dict(F32, stage=3, offload_optimizer="cpu", offload_param="nvme", swap_buffer_size=777),
        "single",
    ),
    "s1_fused": ("s1", dict(F32, stage=1, **CPU), "fused"),
    "s3_fused": ("s3", dict(F32, stage=3, **CPU3), "fused"),
    "s3_nvme_fused": ("s3", dict(F32, stage=3, **NVME3), "fused"),
    "s1_native": ("s1", dict(F32, stage=1, **CPU), "native"),
    "s3_nvme_native": ("s3", dict(F32, stage=3, **NVME3), "native"),
    "s3_nvme_native_exact": ("s3", dict(F32, stage=3, **NVME3), "native-exact"),
    "hpz": (None, dict(F32, stage=3, hpz=True), "single"),
    "hpz_cpu": ("hpz", dict(F32, stage=3, hpz=True, **CPU3), "single"),
    "hpz_nvme": ("hpz", dict(F32, stage=3, hpz=True, **NVME3), "single"),
    "qwz": (None, dict(F32, stage=3, weights=W8), "single"),
    "qwz_cpu": ("qwz", dict(F32, stage=3, weights=W8, **CPU3), "single"),
    "qgz": (None, dict(F32, stage=3, grads=G8), "single"),
    "qgz_nvme": ("qgz", dict(F32, stage=3, grads=G8, **NVME3), "single"),
    "zpp": (None, dict(F32, stage=3, weights=W8, hpz=True, grads=G8, grad_accum_steps=2), "single"),
    "zpp_cpu": ("zpp", dict(F32, stage=3, weights=W8, hpz=True, grads=G8, grad_accum_steps=2, **CPU3), "single"),
    "bf16_s3": (None, dict(stage=3, precision="bf16"), "single"),
    "bf16_s3_nvme": ("bf16_s3", dict(stage=3, precision="bf16", **NVME3), "single"),
    "s0": (None, dict(F32, stage=0), "single"),
}


def _train(rank: int, world: int, kw: dict, cpu_adam: str, nvme: str) -> dict:
    from zeropp.comm import Topology
    from zeropp.runtime import OptimizerConfig, ZeroConfig, ZeroEngine

    if "nvme" in (kw.get("offload_optimizer"), kw.get("offload_param")):
        kw = dict(kw, nvme_path=nvme)
    zc = ZeroConfig(**kw)
    eng = ZeroEngine(
        make_model(),
        config=zc,
        optimizer=OptimizerConfig(lr=LR, weight_decay=0.01),
        topology=Topology(nodes=2, ranks_per_node=world // 2),
        cpu_adam=cpu_adam,
    )
    try:
        res = [eng.train_step(rank_batches(s, zc.grad_accum_steps, rank)) for s in range(STEPS)]
        tiers = {
            "optimizer": eng.optim.memory_by_tier(),
            "params": eng.param_store.memory_by_tier() if eng.param_store is not None else None,
            "swap_host": eng.swap.host_bytes() if eng.swap is not None else 0,
        }
        return {
            "losses": [r.loss for r in res],
            "norms": [r.grad_norm for r in res],
            "memory": eng.memory_report(),
            "num_params": eng.num_params,
            "tiers": tiers,
            "weights": {k: v.numpy() for k, v in eng.consolidated_state_dict().items()},
        }
    finally:
        eng.close()


def _world(rank: int, world: int) -> dict:
    import os

    with tempfile.TemporaryDirectory() as nvme:
        out = {name: _train(rank, world, kw, adam, nvme) for name, (_ref, kw, adam) in RUNS.items()}
        out["leftover_files"] = os.listdir(nvme)  # every engine removed its swap files on close
    return out


@pytest.fixture(scope="module")
def runs():
    return run_world(_world, 4, timeout=300)[0]


def test_offload_matches_the_in_memory_run(runs):
    for name, (ref, _kw, adam) in RUNS.items():
        if ref is None:
            continue
        got, want = runs[name], runs[ref]
        if adam in ("single", "native-exact"):  # same arithmetic: bit-identical
            assert got["losses"] == want["losses"], (name, got["losses"], want["losses"])
            assert got["norms"] == want["norms"], name
            for k, v in want["weights"].items():
                assert (got["weights"][k] == v).all(), (name, k)
        else:
            assert all(abs(a - b) <= FUSED_LOSS_TOL * abs(b) for a, b in zip(got["losses"], want["losses"])), name
            keys = sorted(want["weights"])
            flat = [np.concatenate([r["weights"][k].ravel() for k in keys]) for r in (got, want)]
            err = rel_err(*flat)
            assert err <= FUSED_TOL and (err > 0 or adam == "native"), (name, err)  # fused: its rounding shows
            assert max(float(abs(got["weights"][k] - want["weights"][k]).max()) for k in keys) <= 2 * LR * STEPS
    assert runs["leftover_files"] == []


def test_hpz_with_offload_has_the_right_nonzero_gradient_norm(runs):
    # DeepSpeed users report a zero gradient norm with hpZ + offload; here it is the hpZ run's norm
    for name in ("hpz_cpu", "hpz_nvme", "zpp_cpu"):
        norms = runs[name]["norms"]
        assert all(n > 0.1 for n in norms), (name, norms)
        assert norms == runs[RUNS[name][0]]["norms"], name


def test_fp32_model_state_is_16_10_7_4_bytes_per_parameter_at_4_ranks(runs):
    for stage, per_param in ((0, 16), (1, 10), (2, 7), (3, 4)):
        r = runs[f"s{stage}"]
        got = r["memory"]["total"] / r["num_params"]
        assert abs(got - per_param) <= 0.05 * per_param, (stage, got, r["memory"])


def test_each_tier_holds_its_share_of_the_state(runs):
    def close(got, want):
        return abs(got - want) <= 0.05 * want

    for name in ("s1_cpu", "s2_cpu", "s3_cpu", "s2_nvme", "s3_nvme", "s3_nvme_param_cpu_opt", "bf16_s3_nvme"):
        r = runs[name]
        kw = RUNS[name][1]
        psi, n = r["num_params"], 4
        opt, params = r["tiers"]["optimizer"], r["tiers"]["params"]
        tier = {"cpu": "host", "nvme": "disk"}[kw["offload_optimizer"]]
        # fp32 master + m + v of this rank's shard (+ the fp32 gradient landing buffers on the host)
        assert close(opt[tier], (16 if tier == "host" else 12) * psi / n), (name, opt)
        assert all(v == 0 for k, v in opt.items() if k != tier), (name, opt)  # nothing left on the device
        if kw.get("offload_param", "none") != "none":
            ptier = {"cpu": "host", "nvme": "disk"}[kw["offload_param"]]
            width = 2 if kw["precision"] == "bf16" else 4
            assert close(params[ptier], width * psi / n) and sum(params.values()) == params[ptier], (name, params)
        if "nvme" in (kw["offload_optimizer"], kw.get("offload_param")):  # bounded staging buffers
            assert r["tiers"]["swap_host"] == kw.get("swap_buffers", 4) * kw["swap_buffer_size"] * 4, name
