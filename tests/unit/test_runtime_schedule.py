"""The learning-rate schedule (linear warmup, then constant or cosine) and the loss scalers,
against their formulas and against torch's LambdaLR driving torch.optim.AdamW."""

import math

import pytest
import torch

from zeropp.runtime import DynamicLossScaler, OptimizerConfig, ShardedAdamW, StaticLossScaler


def _formula(step, lr, warmup, schedule, decay, floor):
    """The documented schedule, written independently of the implementation."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if schedule == "constant":
        return lr
    if step >= decay:
        return lr * floor
    t = (step - warmup) / (decay - warmup)
    return lr * (floor + (1 - floor) * (1 + math.cos(math.pi * t)) / 2)


@pytest.mark.parametrize(
    "warmup, schedule, decay, floor",
    [
        (0, "constant", None, 0.1),
        (4, "constant", None, 0.1),
        (0, "cosine", 7, 0.0),
        (3, "cosine", 17, 0.1),
        (5, "cosine", 5, 0.25),
        (1, "cosine", 2, 1.0),
    ],
)
def test_lr_at_follows_the_formula(warmup, schedule, decay, floor):
    cfg = OptimizerConfig(lr=3e-3, warmup_steps=warmup, schedule=schedule, decay_steps=decay, min_lr_ratio=floor)
    for step in range(30):
        assert cfg.lr_at(step) == pytest.approx(_formula(step, 3e-3, warmup, schedule, decay, floor), rel=1e-12, abs=0)
    if warmup:
        assert cfg.lr_at(0) == pytest.approx(3e-3 / warmup) and cfg.lr_at(warmup - 1) == pytest.approx(3e-3)
    if schedule == "cosine":
        assert cfg.lr_at(decay) == cfg.lr_at(decay + 100) == pytest.approx(3e-3 * floor)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(schedule="cosine"), "needs decay_steps"),
        (dict(schedule="cosine", warmup_steps=10, decay_steps=9), "warmup_steps=10 exceeds decay_steps=9"),
        (dict(warmup_steps=-1), "warmup_steps must be an int >= 0"),
        (dict(schedule="cosine", decay_steps=-3), "decay_steps must be an int >= 0"),
        (dict(schedule="cosine", decay_steps=5, min_lr_ratio=-0.1), "min_lr_ratio must be in"),
        (dict(schedule="linear"), "schedule='linear'"),
        (dict(decay_steps=10), "does nothing with schedule='constant'"),
        (dict(lr=-1.0), "lr must be a finite number >= 0"),
    ],
)
def test_bad_schedules_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OptimizerConfig(**kwargs)
    with pytest.raises(ValueError, match="step must be >= 0"):
        OptimizerConfig().lr_at(-1)


@pytest.mark.parametrize("warmup, schedule, decay", [(3, "cosine", 9), (4, "constant", None), (0, "cosine", 6)])
def test_sharded_adamw_with_schedule_matches_torch_adamw_with_lambdalr_bitwise(warmup, schedule, decay):
    torch.manual_seed(0)
    params = [torch.randn(17, 3), torch.randn(7), torch.randn(1)]
    cfg = OptimizerConfig(
        lr=3e-3,
        betas=(0.8, 0.95),
        eps=1e-6,
        weight_decay=0.1,
        warmup_steps=warmup,
        schedule=schedule,
        decay_steps=decay,
        min_lr_ratio=0.2,
    )
    ref = [p.clone().requires_grad_() for p in params]
    topt = torch.optim.AdamW(ref, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(topt, cfg.lr_factor)
    flat = torch.cat([p.reshape(-1) for p in params])  # [59]
    shards = [flat[:20].clone(), flat[20:].clone()]
    opt = ShardedAdamW(shards, cfg)
    for _ in range(12):
        assert opt.lr == topt.param_groups[0]["lr"]
        grads = [torch.randn_like(p) for p in params]
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        topt.step()
        sched.step()
        gflat = torch.cat([g.reshape(-1) for g in grads])
        opt.step([gflat[:20].clone(), gflat[20:].clone()])
        assert torch.equal(torch.cat(opt.masters), torch.cat([p.detach().reshape(-1) for p in ref]))
    assert opt.step_count == 12


def test_loss_scalers():
    s = DynamicLossScaler(2.0**10, window=2)
    seen = []
    for finite in (False, True, True, True, False, True):
        s.update(finite)
        seen.append(s.scale)
    assert seen == [2.0**9, 2.0**9, 2.0**10, 2.0**10, 2.0**9, 2.0**9]
    t = DynamicLossScaler()
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict() == {"scale": 2.0**9, "good_steps": 1}
    st = StaticLossScaler()
    st.update(False)
    st.load_state_dict({"scale": 8.0, "good_steps": 3})
    assert st.scale == 1.0 and st.state_dict()["scale"] == 1.0
    with pytest.raises(ValueError, match="init > 0"):
        DynamicLossScaler(0.0)
