"""The torch trainers: FSDP2 (``fully_shard``) and DDP, with or without zeropp's collectives, behind
the ``trainers.Trainer`` protocol (:class:`TorchTrainer`), and their builders, which the trainer
registry names (``trainer_registry``: ``fsdp2``, ``fsdp2_zeropp``, ``ddp``, ``ddp_zeropp``).

They read the same settings as ZeroEngine (``zero.precision``, ``zero.grad_accum_steps``,
``zero.grad_clip``, the ``optim`` section with its LR schedule) and checkpoint through
``torch.distributed.checkpoint`` in the engine's format (``torch_checkpoint``); ``trainers``
says how activation checkpointing and tied embeddings are handled alike in every trainer.
"""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zeropp.comm.backend import backend_all_reduce
from zeropp.runtime import ZeroConfig

from .config import RunConfig
from .torch_checkpoint import load_dcp, save_dcp
from .trainers import StepOut, build_model, stats_dict


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _bytes(ts: Any) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in ts if isinstance(t, torch.Tensor))


def adamw_with_schedule(params: Any, cfg: RunConfig) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """torch's AdamW over ``params`` with the ``optim`` section's settings, and its LR schedule: the
    same schedule function as ZeroEngine's, as a multiplier of the peak rate."""
    o = cfg.optim
    opt = torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, o.lr_factor)


class TorchTrainer:
    """The loop shared by FSDP2 and DDP: accumulate, clip, AdamW step, LR schedule (the step is
    skipped when the gradient norm is not finite). fp32/bf16 only (``config`` refuses fp16 here),
    so there is no loss scaler and no GradScaler."""

    def __init__(
        self,
        model: nn.Module,
        cfg: RunConfig,
        *,
        autocast: bool,
        session: Any = None,
        feedback: Any = None,
        optimizer: tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler] | None = None,
    ) -> None:
        """``optimizer``: the AdamW and LR schedule already built for ``model``
        (:func:`adamw_with_schedule`; a wrapper such as DeepSpeed's engine takes them first);
        None: built here over ``model.parameters()``."""
        self.model, self.cfg, self.autocast = model, cfg, autocast
        self.session = session
        """The zeropp plug-in's ``zeropp.comm.CommSession`` (its stats, stochastic-rounding counter and
        wait hooks), or None for the stock FSDP2 / DDP collectives."""
        self.stats = session.stats if session is not None else None
        self.feedback = feedback
        """The zeropp plug-in's qgZ error-feedback residuals (``zeropp.comm.ErrorFeedback``) or None:
        saved per rank with each checkpoint, with the stochastic-rounding call counter."""
        self._memory: dict[str, int] = {}
        self.opt, self.sched = optimizer or adamw_with_schedule(model.parameters(), cfg)
        self._origin: Any = None
        """The checkpoint (``checkpoint_io.Origin``) this state was last saved to or loaded from."""
        from zeropp.runtime import memory as mem

        self._created = mem.flat_snapshot("model_creation", self.memory_report(), self._device())
        """Model-state memory once built (the first of :meth:`memory_phases`)."""

    def _forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        from zeropp.runtime.batch import call_model, loss_of

        mb = (idx, targets)
        with torch.autocast(idx.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            return loss_of(call_model(self.model, mb), mb)  # as ZeroEngine: model(*mb), loss from the output

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> StepOut:
        n = len(micro_batches)
        if n != self.cfg.zero.grad_accum_steps:
            raise ValueError(f"got {n} micro-batches but zero.grad_accum_steps={self.cfg.zero.grad_accum_steps}")
        total = 0.0
        for i, (idx, tgt) in enumerate(micro_batches):
            sync = getattr(self.model, "no_sync", None) if i < n - 1 else None
            ctx = sync() if callable(sync) else _Null()
            with ctx:
                loss = self._forward(idx, tgt)
                (loss / n).backward()
            total += float(loss.detach())
        self._memory = self._measure_memory()  # at the end of backward, as ZeroEngine.memory_report()
        clip = self.cfg.zero.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip if clip else float("inf"))
        norm_f = float(_local(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        lr = self.opt.param_groups[0]["lr"]
        # as ZeroEngine: a non-finite norm (global, so the same on every rank) makes no update and
        # does not advance the schedule; the runner's DivergenceGuard then stops the run
        skipped = not math.isfinite(norm_f)
        if not skipped:
            self.opt.step()
            self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return StepOut(loss=total / n, grad_norm=norm_f, skipped=skipped, lr=lr)

    @torch.no_grad()
    def eval_loss(self, idx: torch.Tensor, targets: torch.Tensor) -> float:
        was = self.model.training
        self.model.eval()
        try:
            loss = self._forward(idx, targets).detach().float().reshape(1)
            # the mean over ranks, as ZeroEngine.eval_loss; through the comm context, as the
            # run's last collectives come right after (zeropp.comm.objects says why)
            backend_all_reduce(loss, dist.ReduceOp.SUM, None, async_op=False)
            return float(loss) / dist.get_world_size()
        finally:
            self.model.train(was)

    def memory_report(self) -> dict[str, int]:
        """Model-state bytes this rank held at the end of the last step's backward (gradients still
        there, optimizer states from the step before), measured as ZeroEngine measures its own."""
        return dict(self._memory) if self._memory else self._measure_memory()

    def _measure_memory(self) -> dict[str, int]:
        params = _bytes(self.model.parameters())
        grads = _bytes(p.grad for p in self.model.parameters() if p.grad is not None)
        optim = _bytes(v for s in self.opt.state.values() for v in s.values())
        return {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}

    def memory_phases(self) -> dict[str, Any]:
        """No per-phase accounting here: the flat report after model creation and after the last
        step, all on the device."""
        from zeropp.runtime import memory as mem

        return {
            "model_creation": self._created,
            "step": mem.flat_snapshot("step", self.memory_report(), self._device()),
        }

    def frozen_bytes(self) -> int:
        return 0

    def trained_params(self) -> int | None:
        return None

    def replicated_params(self) -> int:
        return 0

    def comm_stats(self) -> dict[str, int] | None:
        return stats_dict(self.stats)

    def comm_session(self) -> Any:
        return self.session

    def save(self, path: Path, extra: dict[str, Any], keep: int) -> None:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        state = {"model": model_sd, "optim": optim_sd, "sched": self.sched.state_dict()}
        self._origin = save_dcp(
            state, path, extra, per_rank=self._rank_state(), keep=keep, origin=self._origin, device=self._device()
        )

    def load(self, path: Path) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd, "sched": self.sched.state_dict()}
        extra, mine, origin = load_dcp(state, path, device=self._device())
        set_state_dict(self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.sched.load_state_dict(state["sched"])
        self._load_rank_state(mine)
        self._origin = origin
        return extra

    def _device(self) -> torch.device:
        """The process group's device (where the checkpoint agreement flags travel)."""
        return next(self.model.parameters()).device

    def _rank_state(self) -> dict[str, Any]:
        """What only this rank holds and an exact resume needs: the plug-in's stochastic call counter
        and its error-feedback residuals."""
        calls = self.session.stochastic.value if self.session is not None else 0
        return {
            "world_size": dist.get_world_size(),
            "stochastic_calls": calls,
            "feedback": self.feedback.state_dict() if self.feedback is not None else None,
        }

    def _load_rank_state(self, mine: dict[str, Any] | None) -> None:
        if mine is None:  # a checkpoint from before these were saved
            return
        if self.session is not None:
            self.session.stochastic.reset(int(mine["stochastic_calls"]))
        if self.feedback is None:
            return
        if mine.get("feedback") is None or mine["world_size"] != dist.get_world_size():
            if dist.get_rank() == 0:
                print(
                    f"warning: the checkpoint holds no error-feedback residuals for this world of "
                    f"{dist.get_world_size()} ranks; they restart from zero",
                    file=sys.stderr,
                )
            self.feedback.reset()
            return
        self.feedback.load_state_dict(mine["feedback"])

    def close(self) -> None:
        pass


class _Null:
    def __enter__(self) -> None: ...
    def __exit__(self, *a: object) -> None: ...


def _blocks(model: nn.Module, why: str = "trainer=fsdp2 shards them one by one") -> list[nn.Module]:
    """The transformer blocks (``model.blocks``)."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise RuntimeError(f"the model's blocks must be model.blocks (an nn.ModuleList): {why}")
    return list(blocks)


def _maybe_checkpoint(model: nn.Module, cfg: RunConfig) -> None:
    """``train.activation_checkpointing``: checkpoint each block (before FSDP2 / DDP wrap the model)."""
    if cfg.train.activation_checkpointing:
        from zeropp.runtime.activations import checkpoint_blocks

        checkpoint_blocks(_blocks(model, "train.activation_checkpointing=true checkpoints each of them"))


def _fsdp2(cfg: RunConfig, device: torch.device, zeropp_comms: bool) -> TorchTrainer:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build_model(cfg, device)
    _maybe_checkpoint(model, cfg)
    z = cfg.zero
    # the ranks' own device: without a mesh FSDP2 picks the host's accelerator, also for CPU/gloo ranks
    mesh = init_device_mesh(device.type, (cfg.world_size,))
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if z.precision == "bf16"
        else MixedPrecisionPolicy()
    )
    # hpZ in FSDP2's own terms: after forward, keep the parameters sharded over the hpZ group only
    raf: bool | int = (z.hpz_size or cfg.topology.ranks_per_node) if z.hpz else True
    for block in _blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=raf)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=raf)
    # torch >= 2.13 warns when a wrapped module returns a view (the root's logits: nn.Linear
    # reshapes its 3-d output), because an in-place op on it would skip FSDP2's pre-backward hook.
    # This trainer never modifies the outputs in place (loss.backward(), the logits are unused).
    warnings.filterwarnings(
        "ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor", category=UserWarning
    )
    session = feedback = None
    if zeropp_comms:
        from zeropp.comm import CommSession, ErrorFeedback
        from zeropp.comm.fsdp import apply_zeropp_comms

        session = CommSession(cfg.topology)
        feedback = ErrorFeedback.for_spec(z.grads) if z.grads is not None and z.grads.error_feedback else None
        apply_zeropp_comms(model, weights=z.weights, grads=z.grads, session=session, error_feedback=feedback)
    return TorchTrainer(model, cfg, autocast=False, session=session, feedback=feedback)


def _ddp(cfg: RunConfig, device: torch.device, zeropp_hook: bool) -> TorchTrainer:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build_model(cfg, device)
    _maybe_checkpoint(model, cfg)
    z = cfg.zero
    # zero.reduce_bucket_size, when set, caps DDP's buckets (fp32 gradients); else DDP's own default
    bucket: dict[str, Any] = (
        {}
        if z.reduce_bucket_size == ZeroConfig().reduce_bucket_size
        else {"bucket_cap_mb": z.reduce_bucket_size * 4 / 2**20}
    )
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **bucket)
    session = None
    if zeropp_hook:
        from zeropp.comm import CommSession
        from zeropp.comm.ddp import QuantizedAllReduceState, quantized_allreduce_hook

        session = CommSession(cfg.topology)
        state = QuantizedAllReduceState(grads=z.grads, session=session)
        ddp.register_comm_hook(state, quantized_allreduce_hook)
    else:
        # the stock all-reduce, issued from Python so CommWatch sees its bytes (DDP's default
        # reducer calls the C++ collective directly); same arithmetic as DDP's built-in path
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        ddp.register_comm_hook(None, allreduce_hook)
    return TorchTrainer(
        ddp, cfg, autocast=z.precision == "bf16", session=session, feedback=state.feedback if zeropp_hook else None
    )


def build_fsdp2(cfg: RunConfig, device: torch.device) -> TorchTrainer:
    """``trainer=fsdp2``: stock FSDP2."""
    return _fsdp2(cfg, device, False)


def build_fsdp2_zeropp(cfg: RunConfig, device: torch.device) -> TorchTrainer:
    """``trainer=fsdp2_zeropp``: FSDP2 with zeropp's collectives."""
    return _fsdp2(cfg, device, True)


def build_ddp(cfg: RunConfig, device: torch.device) -> TorchTrainer:
    """``trainer=ddp``: stock DDP."""
    return _ddp(cfg, device, False)


def build_ddp_zeropp(cfg: RunConfig, device: torch.device) -> TorchTrainer:
    """``trainer=ddp_zeropp``: DDP with zeropp's quantized all-reduce hook."""
    return _ddp(cfg, device, True)
