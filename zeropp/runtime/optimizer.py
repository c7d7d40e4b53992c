"""Sharded AdamW on fp32 master shards.

Each rank updates only the slice of every flat unit it owns (the whole unit for replicated
units). The arithmetic is the single-tensor path of ``torch.optim.AdamW`` operation for
operation, so an update of a flat shard is bit-identical to ``AdamW(foreach=False)`` applied to
the same elements one parameter at a time; that is what lets the tests demand exact parity.
"""

from __future__ import annotations

import torch

from .config import OptimizerConfig


class ShardedAdamW:
    """fp32 master weights, first and second moments, for a list of flat shards."""

    def __init__(self, masters: list[torch.Tensor], cfg: OptimizerConfig) -> None:
        for m in masters:
            if m.dtype != torch.float32:
                raise TypeError(f"master shards must be fp32, got {m.dtype}")
        self.cfg = cfg
        self.masters = masters  # each [S] fp32
        self.exp_avg = [torch.zeros_like(m) for m in masters]
        self.exp_avg_sq = [torch.zeros_like(m) for m in masters]
        self.step_count = 0

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor]) -> None:
        """One AdamW update; ``grads[i]`` is the fp32 gradient of ``masters[i]`` (same shape). The
        rate is the schedule's ``cfg.lr_at(steps taken so far)``."""
        lr, (beta1, beta2), eps, wd = self.lr, self.cfg.betas, self.cfg.eps, self.cfg.weight_decay
        self.step_count += 1
        step = float(self.step_count)  # torch keeps the step as a float tensor and reads .item()
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2**0.5
        for p, g, m, v in zip(self.masters, grads, self.exp_avg, self.exp_avg_sq):
            if wd != 0:
                p.mul_(1 - lr * wd)
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
            p.addcdiv_(m, denom, value=-step_size)

    @property
    def lr(self) -> float:
        """The learning rate the next ``step`` uses."""
        return self.cfg.lr_at(self.step_count)

    def nbytes(self) -> int:
        """Bytes of master weights plus both moments held by this rank."""
        return sum(t.numel() * t.element_size() for ts in (self.masters, self.exp_avg, self.exp_avg_sq) for t in ts)

    STATE = ("masters", "exp_avg", "exp_avg_sq")
    """Names of the per-shard fp32 state lists (what a checkpoint stores per unit)."""

    @torch.no_grad()
    def load_state(self, state: dict[str, list[torch.Tensor]], step: int) -> None:
        """Copy ``state[name][i]`` into each list of :data:`STATE` (same shapes) and set the step count."""
        for name in self.STATE:
            mine, theirs = getattr(self, name), state[name]
            if len(mine) != len(theirs) or any(a.shape != b.shape for a, b in zip(mine, theirs)):
                raise ValueError(f"checkpoint optimizer state {name!r} does not match this partitioning")
            for a, b in zip(mine, theirs):
                a.copy_(b)
        self.step_count = int(step)


