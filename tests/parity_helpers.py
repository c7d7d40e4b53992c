"""The exactness reference of the runtime tests: the training settings (10 steps, 2 micro-batches,
clipping that engages) and :func:`check_parity`, which compares each engine's losses, gradient
norms and weights with single-process training on the global batch (the bounds and their reasons
are in ``tests/distributed/test_runtime_parity.py``)."""

import torch

from tests.runtime_helpers import TINY, reference_train, rel_err

STEPS, ACCUM, CLIP, LR, WD = 10, 2, 0.5, 1e-3, 0.01
"""Steps, micro-batches per step, clipping threshold, learning rate and weight decay."""

BASE = dict(grad_accum_steps=ACCUM, grad_clip=CLIP)
STAGES = [dict(BASE, stage=s) for s in (0, 1, 2, 3)]
"""Stages 0-3 with accumulation and clipping."""


def check_parity(results, world, configs, device="cpu", cfg=TINY):
    """Every config's losses, norms and weights against single-process training (on ``device``)."""
    ref_losses, ref_norms, ref_w = reference_train(STEPS, world, ACCUM, lr=LR, wd=WD, clip=CLIP, device=device, cfg=cfg)
    assert max(ref_norms) > CLIP, "the test must exercise clipping"
    for cfg, r in zip(configs, results[0]):
        for other in results[1:]:  # every rank reports the same global loss
            assert other[configs.index(cfg)]["losses"] == r["losses"]
        for a, b in zip(r["losses"], ref_losses):
            assert abs(a - b) <= 1e-5 * abs(b), (cfg, r["losses"], ref_losses)
        for a, b in zip(r["norms"], ref_norms):
            assert abs(a - b) <= 1e-5 * abs(b), (cfg, r["norms"], ref_norms)
        assert not any(r["skipped"])
        w = r["weights"]
        assert set(w) == set(ref_w)
        flat_got = torch.cat([torch.as_tensor(w[k]).reshape(-1) for k in ref_w])
        flat_ref = torch.cat([ref_w[k].reshape(-1) for k in ref_w])
        assert rel_err(flat_got, flat_ref) <= 1e-5, cfg
        worst = max(rel_err(w[k], ref_w[k]) for k in ref_w)
        assert worst <= 2e-4, (cfg, worst)
