"""One interface over the training stacks a run can compare, and the one factory that builds them.

``trainer=zeropp`` is zeropp's ZeroEngine (stages 0-3 with qwZ/hpZ/qgZ); ``fsdp2`` is PyTorch's
``fully_shard`` on every block and the root (``zero.hpz`` = ``reshard_after_forward`` to the hpZ
group, FSDP2's own form of hpZ); ``fsdp2_zeropp`` the same with zeropp's collectives plugged in
(``zero.weights`` / ``zero.grads``); ``ddp`` is DistributedDataParallel, ``ddp_zeropp`` DDP with
zeropp's quantized gradient all-reduce hook (``zero.grads``). All of them read the same settings
(``zero.precision``, ``zero.grad_accum_steps``, ``zero.grad_clip``, the ``optim`` section with its
LR schedule), so the runner measures them on equal terms; each trainer's
``trainer_registry.TrainerSpec`` names its builder here and the settings it honours (the config
refuses the others). Checkpoints go through ``torch.distributed.checkpoint`` everywhere.

``train.activation_checkpointing`` is honoured by every trainer, the same way: torch's
non-reentrant ``torch.utils.checkpoint`` around each of the GPT's blocks
(``zeropp.runtime.activations.checkpoint_blocks``; ZeroEngine applies it itself so that stage 3
re-gathers the block for the recomputation). The block's ``forward`` is replaced in place rather
than the block wrapped (torch's ``checkpoint_wrapper`` lives in a private module and renames the
parameters), so parameter names and checkpoints are the same with and without it. FSDP2 shards
the blocks after that, so its unshard/reshard hooks stay outside the recomputed region.

Tied embeddings (``model.tie_embeddings``, on by default): the GPT's head weight is its token
embedding, both in the root. ZeroEngine keeps it as one slot of its root unit; FSDP2's
``fully_shard`` on the root module manages it as one sharded parameter (it is outside every
block); DDP and the optimizers see it once in ``model.parameters()``. Every trainer calls the model
and finds the loss the engine's way (``zeropp.runtime.batch``: a tuple micro-batch is
``model(*mb)``, the loss the output's last element for the GPT).
"""

from __future__ import annotations

import dataclasses
import datetime
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from .config import RunConfig
from .trainer_registry import TRAINER_SPECS, resolve_builder


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepOut:
    """What one optimizer step reports."""

    loss: float
    """Mean training loss over this rank's micro-batches."""
    grad_norm: float | None = None
    """Global gradient norm before clipping, when the trainer computes it."""
    skipped: bool = False
    """True when the step made no update because the gradient norm was not finite (every trainer
    skips such a step, so the weights stay those of the step before)."""
    comm_wait_s: float | None = None
    """The trainer's own measure of time blocked on communication, when it has one (ZeroEngine)."""
    lr: float | None = None
    """Learning rate used by this step."""
    loss_scale: float | None = None
    """fp16 loss scale this step used (ZeroEngine; None when the trainer scales nothing)."""


class Trainer(Protocol):
    """What the runner needs from a training stack: everything the worker calls is here."""

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> StepOut:
        """One optimizer step over this rank's micro-batches (``zero.grad_accum_steps`` of them)."""
        ...

    def eval_loss(self, idx: torch.Tensor, targets: torch.Tensor) -> float:
        """Collective: the held-out loss of one batch, the mean over ranks."""
        ...

    def memory_report(self) -> dict[str, int]:
        """Model-state bytes this rank holds (``params``, ``grads``, ``optimizer``, ``total``, ...)."""
        ...

    def memory_phases(self) -> dict[str, Any]:
        """Phase name -> this rank's ``zeropp.runtime.memory.MemorySnapshot`` (per tier): the
        engine's own per-phase snapshots, or at least the state after model creation and at the
        end of the last step."""
        ...

    def frozen_bytes(self) -> int:
        """Bytes of frozen (not trained) weight shards this rank stores apart from the trained
        state (the engine's stage-3 frozen units); 0 when it keeps none."""
        ...

    def trained_params(self) -> int | None:
        """Parameters the optimizer updates, when the trainer counts them itself (the expected
        model-state memory then uses this instead of the model's size); None otherwise."""
        ...

    def replicated_params(self) -> int:
        """Of :meth:`trained_params`, those every rank keeps whole with their whole optimizer state
        whatever the stage (the engine's stage-3 ``persistent`` unit, under
        ``zero.persistence_threshold``); 0 when none."""
        ...

    def comm_stats(self) -> dict[str, int] | None:
        """Bytes its own collectives moved so far, ``{"<kind>.<link>": bytes}``; None: not counted."""
        ...

    def comm_session(self) -> Any:
        """Its ``zeropp.comm.CommSession`` (CommWatch times the waits through it), or None."""
        ...

    def save(self, path: Path, extra: dict[str, Any], keep: int) -> None:
        """Collective: a new checkpoint version under ``path`` holding ``extra``; ``keep`` newest kept."""
        ...

    def load(self, path: Path) -> dict[str, Any]:
        """Collective: load the newest checkpoint under ``path``; returns the ``extra`` saved with it."""
        ...

    def close(self) -> None:
        """Release what it holds (threads, swap files); the process group stays up."""
        ...


def build_model(cfg: RunConfig, device: torch.device) -> nn.Module:
    """The model of ``cfg.model`` on ``device``, identical on every rank (seeded): the built-in GPT
    (``GPTConfig``) or a Hugging Face causal LM (``HFConfig``, ``model=hf``; the ``hf`` extra). Both
    are ``model(idx, targets) -> (logits, loss)`` with their blocks as ``model.blocks``."""
    from zeropp.models import GPT, HFConfig, build_hf_model

    torch.manual_seed(cfg.train.seed)
    if isinstance(cfg.model, HFConfig):
        return build_hf_model(cfg.model).to(device)
    return GPT(cfg.model).to(device)


def meta_model(cfg: RunConfig) -> nn.Module:
    """The model of ``cfg.model`` built on the meta device: shapes only, no memory and no weights
    read (what the runner's pre-launch size checks and the plan count)."""
    with torch.device("meta"):
        return build_model(cfg, torch.device("meta"))


def stats_dict(stats: Any) -> dict[str, int] | None:
    """``CommStats.snapshot()`` flattened to ``{"<kind>.<link>": bytes}``."""
    if stats is None:
        return None
    out: dict[str, int] = {}

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), x)
        elif isinstance(v, (int, float)):
            out[prefix] = int(v)

    for k, v in stats.snapshot().items():
        walk(".".join(map(str, k)) if isinstance(k, tuple) else str(k), v)
    return out


class ZeroTrainer:
    """zeropp.runtime.ZeroEngine behind the Trainer interface (the engine applies the LR schedule)."""

    def __init__(self, cfg: RunConfig, device: torch.device) -> None:
        from zeropp.runtime import ZeroEngine

        model = build_model(cfg, device)
        if cfg.topology.tp > 1:  # split the blocks over the tp dimension first; ZeRO then works over dp
            from zeropp.runtime.tensor_parallel import make_mesh, parallelize

            model = parallelize(model, make_mesh(cfg.topology))
        self.engine = ZeroEngine(
            model,
            config=cfg.zero,
            optimizer=cfg.optim,
            topology=cfg.topology,
            activation_checkpointing=cfg.train.activation_checkpointing,
            comm_timeout=datetime.timedelta(seconds=cfg.launcher.pg_timeout_s),  # the process groups' own
            call_timeout=datetime.timedelta(seconds=cfg.launcher.pg_timeout_s),  # (every rank calls; no tighter)
        )

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> StepOut:
        r = self.engine.train_step(micro_batches)
        return StepOut(
            loss=float(r.loss),
            grad_norm=float(r.grad_norm),
            skipped=bool(r.skipped),
            comm_wait_s=float(r.comm_wait_s),
            lr=r.lr,
            loss_scale=float(r.loss_scale),
        )

    def eval_loss(self, idx: torch.Tensor, targets: torch.Tensor) -> float:
        return float(self.engine.eval_loss(idx, targets))

    def memory_report(self) -> dict[str, int]:
        return {k: int(v) for k, v in self.engine.memory_report().items()}

    def memory_phases(self) -> dict[str, Any]:
        """The engine's own per-phase, per-tier snapshots."""
        return dict(self.engine.memory_phases())

    def frozen_bytes(self) -> int:
        """Bytes of the stage-3 frozen shards (quantized with ``zero.quantize_frozen``)."""
        if not self.engine.frozen_units:
            return 0
        from zeropp.runtime.frozen import frozen_bytes

        return frozen_bytes(self.engine.frozen)

    def trained_params(self) -> int | None:
        return int(self.engine.num_params)

    def replicated_params(self) -> int:
        pers = self.engine.persistent
        return 0 if pers is None else sum(p.numel() for p in pers.params)

    def comm_stats(self) -> dict[str, int] | None:
        return stats_dict(self.engine.comm_stats)

    def comm_session(self) -> Any:
        """The engine's ``zeropp.comm.CommSession`` (CommWatch times its waits through its hooks)."""
        return self.engine.comm_session

    def save(self, path: Path, extra: dict[str, Any], keep: int) -> None:
        self.engine.save_checkpoint(path, extra=extra, keep=keep)

    def load(self, path: Path) -> dict[str, Any]:
        return dict(self.engine.load_checkpoint(path) or {})

    def close(self) -> None:
        self.engine.close()


def build_trainer(cfg: RunConfig, device: torch.device) -> Trainer:
    """The trainer named by ``cfg.trainer.name``, built by its registered spec's builder (after
    ``dist.init_process_group``)."""
    trainer: Trainer = resolve_builder(TRAINER_SPECS[cfg.trainer.name])(cfg, device)
    return trainer
