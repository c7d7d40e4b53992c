"""The training loop's measurements: per-step figures, their records, the progress line, and the
summary gathered from every rank at the end.

Per step: the loss, the wait on communication and the gradient norm are all-reduced into the
means every rank judges divergence by (bitwise the same inputs, hence the same verdict), and the
CPU time of every rank's process into their sum (``cpu_s``: all threads, the backend's and the
comm worker's included, so ``cpu_s / (step time x cores)`` says how busy the step kept the cores
of a host the ranks share); rank 0
writes them to ``metrics.jsonl`` and wandb every ``train.log_every`` steps (and at the last or a
diverged step). Steps after ``train.throughput_skip_steps`` are summed into this rank's report
(bytes on the wire, the trainer's own bytes and waits; on an emulated cluster, each node's first
rank also the bytes its node's uplink sent, the kernel's counter), which :meth:`RunMetrics.finish` turns, on
rank 0, into ``summary.json`` and ``memory.json``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zeropp.comm.backend import backend_all_reduce
from zeropp.runtime.divergence import DivergenceError

from ..cluster.netns import interface_tx_bytes
from .config import RunConfig
from .console import Progress, print_summary
from .metrics import MetricsFile, build_summary, tokens_per_step, write_memory_json, write_summary
from .trainers import StepOut, Trainer
from .wandb_log import WandbLogger, flatten


def _delta(now: dict[str, int] | None, before: dict[str, int] | None) -> dict[str, int] | None:
    if now is None:
        return None
    before = before or {}
    return {k: v - before.get(k, 0) for k, v in now.items() if v - before.get(k, 0)}


def _add(acc: dict[str, float], d: dict[str, int] | None) -> None:
    for k, v in (d or {}).items():
        acc[k] = acc.get(k, 0) + v


def sum_over_ranks(t: torch.Tensor) -> None:
    """In place, the sum over the process group, through the comm context (it holds the run's
    collectives in order)."""
    backend_all_reduce(t, dist.ReduceOp.SUM, None, async_op=False)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepStats:
    """One step's figures: this rank's own and the means over ranks."""

    step: int
    """The optimizer step (1-based)."""
    out: StepOut
    """What this rank's trainer reported."""
    dt: float
    """This rank's step time in seconds."""
    wire: dict[str, int]
    """Bytes CommWatch saw on the wire during the step, ``{"<kind>.<link>": bytes}``."""
    engine_bytes: dict[str, int] | None
    """The trainer's own count of bytes moved in the step (None: it counts none)."""
    loss: float
    """Mean loss over ranks."""
    wait: float
    """Mean seconds blocked on communication (CommWatch), over ranks."""
    engine_wait: float
    """Mean of the trainer's own comm wait, over ranks."""
    grad_norm: float | None
    """The gradient norm, reduced (None when the trainer computes none)."""
    skipped: bool
    """Whether any rank skipped the step."""
    cpu_s: float
    """CPU seconds the step took, summed over ranks: each rank's process CPU time (user + system,
    every thread) between the previous step's measurement and this one's."""


class RunMetrics:
    """Everything measured in a run: per-step means, records, progress, the rank's report."""

    def __init__(
        self,
        cfg: RunConfig,
        spec: dict[str, Any],
        run_dir: Path,
        *,
        rank: int,
        world: int,
        device: torch.device,
        start: int,
        all_reduce: Callable[[torch.Tensor], None] = sum_over_ranks,
    ) -> None:
        self.cfg, self.spec, self.run_dir = cfg, spec, run_dir
        self.rank, self.world, self.device, self.start = rank, world, device, start
        self.all_reduce = all_reduce
        """Collective sum in place (the process group's; a test passes its own)."""
        self.lead = rank == 0
        self.label: str = spec.get("label") or cfg.describe()
        self.file = MetricsFile(run_dir / "metrics.jsonl", first_step=start + 1) if self.lead else None
        self.wandb = (
            WandbLogger(
                cfg.logger,
                run_dir=run_dir,
                name=spec.get("name") or self.label,
                group=spec.get("group"),
                config=cfg.to_dict() | {"overrides": spec.get("overrides", [])},
            )
            if self.lead
            else None
        )
        self.progress = Progress(cfg.train.steps, start=start, enabled=self.lead and cfg.launcher.progress)
        self.tokens_per_step = tokens_per_step(cfg)
        self.wire_tot: dict[str, float] = {}
        self.engine_tot: dict[str, float] | None = None
        self.wait_tot = self.engine_wait_tot = 0.0
        self.measured = 0
        self.step_times: list[float] = []
        self.losses: list[float] = []
        self._engine_before: dict[str, int] | None = None
        self.transport: dict[str, str] | None = None
        """The trainer's ``zero.transport``, requested and resolved, with the reason (None: the
        trainer's collectives are the backend's, nothing to choose)."""
        self.cpu_tot = 0.0
        self._cpu_mark: float | None = None
        # the emulated cluster's uplink counter, read by each node's first rank (the ranks of node i
        # are i*rpn .. i*rpn+rpn-1, each under its node namespace with GLOO_SOCKET_IFNAME = the uplink)
        lead_of_node = cfg.cluster.name == "emulated" and rank % cfg.topology.ranks_per_node == 0
        self.uplink = os.environ.get("GLOO_SOCKET_IFNAME", "") if lead_of_node else ""
        self.uplink_tot: int | None = None
        self._tx_mark: int | None = None

    def begin(self, trainer: Trainer) -> None:
        """Before the first step: the trainer's byte counters so far (model creation's) and the
        process's CPU time so far."""
        self._engine_before = trainer.comm_stats()
        choice = getattr(trainer.comm_session(), "transport", None)  # a zeropp session's resolved transport
        self.transport = None if choice is None else choice.as_dict()
        self._cpu_mark = time.process_time()
        self._tx_mark = interface_tx_bytes(self.uplink) if self.uplink else None

    def _tx_since_mark(self) -> int | None:
        """Bytes this node's uplink sent since the last mark (None: not a node's first rank of an
        emulated cluster, or no counter); moves the mark."""
        if not self.uplink:
            return None
        now = interface_tx_bytes(self.uplink)
        before, self._tx_mark = self._tx_mark, now
        return now - before if now is not None and before is not None else None

    def _cpu_since_mark(self) -> float:
        """This process's CPU seconds (every thread) since the last mark; moves the mark."""
        now = time.process_time()
        before, self._cpu_mark = self._cpu_mark, now
        return now - before if before is not None else 0.0

    def observe(
        self, step: int, out: StepOut, dt: float, wire: dict[str, int], wait: float, trainer: Trainer
    ) -> StepStats:
        """Collective: account one step and reduce its figures over ranks."""
        cpu = self._cpu_since_mark()
        tx = self._tx_since_mark()
        now = trainer.comm_stats()
        eng = _delta(now, self._engine_before)
        self._engine_before = now
        if step > self.cfg.train.throughput_skip_steps:
            self.measured += 1
            self.wait_tot += wait
            self.engine_wait_tot += out.comm_wait_s or 0.0
            self.cpu_tot += cpu
            if tx is not None:
                self.uplink_tot = (self.uplink_tot or 0) + tx
            _add(self.wire_tot, wire)
            if eng is not None:
                self.engine_tot = self.engine_tot or {}
                _add(self.engine_tot, eng)
        red = torch.tensor(
            [out.loss, wait, out.comm_wait_s or 0.0, out.grad_norm or 0.0, float(out.skipped), cpu],
            dtype=torch.float64,
            device=self.device,
        )
        self.all_reduce(red)
        loss, wait_mean, eng_wait_mean, norm_mean, skipped_mean, cpu_mean = (
            float(x) / self.world for x in red.tolist()
        )
        self.losses.append(loss)
        self.step_times.append(dt)
        return StepStats(
            step=step,
            out=out,
            dt=dt,
            wire=wire,
            engine_bytes=eng,
            loss=loss,
            wait=wait_mean,
            engine_wait=eng_wait_mean,
            grad_norm=None if out.grad_norm is None else norm_mean,
            skipped=skipped_mean > 0,
            cpu_s=cpu_mean * self.world,
        )

    def log(self, s: StepStats, eval_loss: float | None, *, last: bool) -> None:
        """Rank 0: the step's record (every ``train.log_every`` steps, and when ``last``: the final
        or a diverged step); every rank: the progress line."""
        tps = self.tokens_per_step / s.dt if s.dt > 0 else None
        if self.lead and (s.step % self.cfg.train.log_every == 0 or s.step == self.cfg.train.steps or last):
            rec = {
                "step": s.step,
                "loss": s.loss,
                "grad_norm": s.out.grad_norm,
                "skipped": s.out.skipped,
                "lr": s.out.lr,
                "step_time_s": s.dt,
                "tokens_per_s": tps,
                "comm_wait_s": s.wait,
                "engine_comm_wait_s": s.engine_wait if s.out.comm_wait_s is not None else None,
                "comm_bytes": s.wire,
                "engine_comm_bytes": s.engine_bytes,
                "cpu_s": s.cpu_s,
                "eval_loss": eval_loss,
            }
            assert self.file is not None and self.wandb is not None
            self.file.write(rec)
            self.wandb.log(flatten({k: v for k, v in rec.items() if k != "step" and v is not None}), step=s.step)
        self.progress.update(s.step, loss=s.loss, step_time=s.dt, tokens_per_s=tps or 0.0)

    def rank_report(self, trainer: Trainer) -> dict[str, Any]:
        """This rank's totals and memory, for the summary (gathered from every rank)."""
        return {
            "rank": self.rank,
            "wire_bytes": self.wire_tot,
            "engine_bytes": self.engine_tot,
            "wait_s": self.wait_tot,
            "engine_wait_s": self.engine_wait_tot,
            "cpu_s": self.cpu_tot,
            "uplink_tx_bytes": self.uplink_tot,
            "measured_steps": self.measured,
            "memory": trainer.memory_report(),
            "state_params": trainer.trained_params(),
            "frozen_bytes": trainer.frozen_bytes(),
            "replicated_params": trainer.replicated_params(),
            "memory_phases": {k: v.to_dict() for k, v in trainer.memory_phases().items()},
        }

    def finish(
        self,
        gathered: list[Any],
        *,
        eval_loss: float | None,
        backend: str,
        checkpoint: str | None,
        diverged: DivergenceError | None,
        skipped_steps: int,
    ) -> dict[str, Any]:
        """Rank 0: ``summary.json`` and ``memory.json``, the logger's final record, the summary table
        (not for a diverged run: the runner's one error message says what happened)."""
        cfg, spec = self.cfg, self.spec
        summary = build_summary(
            cfg=cfg,
            rank_reports=gathered,
            step_times=self.step_times,
            losses=self.losses,
            eval_loss=eval_loss,
            n_params=cfg.model.num_params(),
            run_dir=str(self.run_dir),
            overrides=spec.get("overrides", []),
            device=str(self.device),
            backend=backend,
            label=self.label,
            model_name=spec.get("model_name", ""),
            first_step=self.start + 1,
            divergence=None if diverged is None else diverged.record(),
            skipped_steps=skipped_steps,
        )
        summary["checkpoint"] = checkpoint
        summary["transport"] = self.transport
        assert self.file is not None and self.wandb is not None
        self.file.close()
        summary["wandb_dir"] = self.wandb.dir
        write_summary(self.run_dir / "summary.json", summary)
        write_memory_json(self.run_dir / "memory.json", summary)
        skip = ("config", "loss", "memory_per_rank", "memory_by_phase", "memory_expected", "divergence")
        self.wandb.finish(flatten({k: v for k, v in summary.items() if k not in skip}))
        if diverged is None:
            print_summary(summary)
        return summary
