"""A trainer outside the built-in five, for the registry's tests: plain SGD on the GPT, replicated
on every rank, no checkpoints (its spec says so, so the config refuses checkpoint settings).

:data:`TOY_SPEC` registers it as ``trainer=toy`` (``monkeypatch.setitem(TRAINER_SPECS, "toy",
TOY_SPEC)``); :class:`FakeTrainer` is a trainer whose steps return scripted figures, for testing the
worker's collaborators without a model.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zeropp.comm.backend import backend_all_reduce
from zeropp.experiments.runner.config import RunConfig
from zeropp.experiments.runner.trainer_registry import TrainerSpec
from zeropp.experiments.runner.trainers import StepOut, build_model
from zeropp.runtime import memory as mem

TOY_SPEC = TrainerSpec(
    name="toy",
    builder="tests.toy_trainer:ToyTrainer",
    honours=frozenset({"zero.precision", "zero.grad_accum_steps"}),
    stage_note="the toy replicates everything",
    fixed_stage=0,
    precisions=("fp32",),
    checkpoint=False,
)


class ToyTrainer:
    """The ``Trainer`` protocol at its simplest: one model per rank, gradients averaged over ranks."""

    def __init__(self, cfg: RunConfig, device: torch.device) -> None:
        self.model = build_model(cfg, device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=cfg.optim.lr)
        self.device = device
        self.created = mem.flat_snapshot("model_creation", self.memory_report(), device)

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> StepOut:
        total = 0.0
        for idx, tgt in micro_batches:
            _, loss = self.model(idx, tgt)
            (loss / len(micro_batches)).backward()
            total += float(loss.detach())
        for p in self.model.parameters():
            if p.grad is not None:
                backend_all_reduce(p.grad, dist.ReduceOp.AVG, None, async_op=False)
        norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), float("inf")))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return StepOut(loss=total / len(micro_batches), grad_norm=norm, lr=self.opt.param_groups[0]["lr"])

    @torch.no_grad()
    def eval_loss(self, idx: torch.Tensor, targets: torch.Tensor) -> float:
        loss = self.model(idx, targets)[1].detach().reshape(1)
        backend_all_reduce(loss, dist.ReduceOp.AVG, None, async_op=False)
        return float(loss)

    def memory_report(self) -> dict[str, int]:
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return {"params": params, "grads": 0, "optimizer": 0, "total": params}

    def memory_phases(self) -> dict[str, Any]:
        return {"model_creation": self.created, "step": mem.flat_snapshot("step", self.memory_report(), self.device)}

    def frozen_bytes(self) -> int:
        return 0

    def trained_params(self) -> int | None:
        return None

    def replicated_params(self) -> int:
        return 0

    def comm_stats(self) -> dict[str, int] | None:
        return None

    def comm_session(self) -> Any:
        return None

    def save(self, path: Path, extra: dict[str, Any], keep: int) -> None:
        raise NotImplementedError("trainer=toy keeps no checkpoints (its TrainerSpec has checkpoint=False)")

    def load(self, path: Path) -> dict[str, Any]:
        raise NotImplementedError("trainer=toy keeps no checkpoints (its TrainerSpec has checkpoint=False)")

    def close(self) -> None:
        pass


class FakeTrainer:
    """A trainer with no model: ``losses`` scripts each step's loss (NaN makes a non-finite step),
    ``save`` / ``load`` record what they were given, ``eval_loss`` returns the batch's first token."""

    def __init__(
        self,
        losses: list[float] | None = None,
        *,
        resume_extra: dict[str, Any] | None = None,
        transport: str | None = None,
    ) -> None:
        self.losses = list(losses or [])
        self.transport = transport  # resolved transport its session reports (None: no session)
        self.saves: list[tuple[Path, dict[str, Any], int]] = []
        self.loads: list[Path] = []
        self.resume_extra = resume_extra or {}
        self.bytes = 0

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> StepOut:
        loss = self.losses.pop(0)
        self.bytes += 100
        return StepOut(loss=loss, grad_norm=loss if math.isfinite(loss) else float("nan"), lr=0.1, comm_wait_s=0.5)

    def eval_loss(self, idx: torch.Tensor, targets: torch.Tensor) -> float:
        return float(idx[0, 0])

    def memory_report(self) -> dict[str, int]:
        return {"params": 8, "grads": 8, "optimizer": 16, "total": 32}

    def memory_phases(self) -> dict[str, Any]:
        return {"step": mem.flat_snapshot("step", self.memory_report(), torch.device("cpu"))}

    def frozen_bytes(self) -> int:
        return 0

    def trained_params(self) -> int | None:
        return 2

    def replicated_params(self) -> int:
        return 0

    def comm_stats(self) -> dict[str, int] | None:
        return {"all_gather.intra": self.bytes}

    def comm_session(self) -> Any:
        if self.transport is None:
            return None
        from zeropp.comm import CommSession
        from zeropp.comm.shm_choice import TransportChoice

        session = CommSession()
        session.transport = TransportChoice(requested="auto", resolved=self.transport, reason="")
        return session

    def save(self, path: Path, extra: dict[str, Any], keep: int) -> None:
        self.saves.append((path, extra, keep))

    def load(self, path: Path) -> dict[str, Any]:
        self.loads.append(path)
        return dict(self.resume_extra)

    def close(self) -> None:
        pass
