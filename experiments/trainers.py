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
import math
import sys
import warnings
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from zeropp.comm.backend import backend_all_reduce
from zeropp.runtime import ZeroConfig

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


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _bytes(ts: Any) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in ts if isinstance(t, torch.Tensor))


def _stats_dict(stats: Any) -> dict[str, int] | None:
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

    def comm_stats(self) -> dict[str, int] | None:
        return _stats_dict(self.engine.comm_stats)

    def comm_session(self) -> Any:
        """The engine's ``zeropp.comm.CommSession`` (CommWatch times its waits through its hooks)."""
        return self.engine.comm_session

    def save(self, path: Path, extra: dict[str, Any], keep: int) -> None:
        self.engine.save_checkpoint(path, extra=extra, keep=keep)

    def load(self, path: Path) -> dict[str, Any]:
        return dict(self.engine.load_checkpoint(path) or {})

    def close(self) -> None:
        self.engine.close()


class TorchTrainer:
    """The loop shared by FSDP2 and DDP: accumulate, clip, AdamW step, LR schedule (the step is
    skipped when the gradient norm is not finite). fp32/bf16 only (``config`` refuses fp16 here),
    so there is no loss scaler and no GradScaler."""

    def __init__(
        self, model: nn.Module, cfg: RunConfig, *, autocast: bool, session: Any = None, feedback: Any = None
    ) -> None:
        self.model, self.cfg, self.autocast = model, cfg, autocast
        self.session = session
        """The zeropp plug-in's ``zeropp.comm.CommSession`` (its stats, stochastic-rounding counter and
        wait hooks), or None for the stock FSDP2 / DDP collectives."""
        self.stats = session.stats if session is not None else None
        self.feedback = feedback
        """The zeropp plug-in's qgZ error-feedback residuals (``zeropp.comm.ErrorFeedback``) or None:
        saved per rank with each checkpoint, with the stochastic-rounding call counter."""
        self._memory: dict[str, int] = {}
        o = cfg.optim
        self.opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
        # the same schedule function as ZeroEngine's, as a multiplier of the peak rate
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, o.lr_factor)
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

    def comm_stats(self) -> dict[str, int] | None:
        return _stats_dict(self.stats)

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
        state = {"model": model_sd, "optim": optim_sd, "sched": self.sched.state_dict()}
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


def save_dcp(
    state: dict[str, Any],
    path: Path,
    extra: dict[str, Any],
    per_rank: dict[str, Any] | None = None,
    *,
    keep: int = 2,
    origin: Any = None,
    device: torch.device | None = None,
) -> Any:
    """Collective: ``state`` (a DCP state dict) as a new ``path/ckpt-<step>-<nonce>`` version in the
    engine's format (``zeropp.runtime.checkpoint_io``, ``"kind": "torch"``): every file checksummed,
    ``LATEST`` moved only after every rank has written, NaN/inf values refused, this run's ``keep``
    newest versions kept (``origin``: the version this state continues, None for a fresh run).
    ``per_rank``: this rank's own state (``rank-<r>.pt``: residuals and counters that are neither
    sharded nor replicated, so DCP has no place for them). Returns the new version (an ``Origin``)."""
    from zeropp.runtime import checkpoint_io as cio

    step = extra.get("step", 0)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint extra['step']={step!r}: the training step must be an int >= 0")

    def prepare() -> cio.Prepared:
        return cio.Prepared(
            state=state, meta={"step": step, "world_size": dist.get_world_size(), "extra": extra}, rank_state=per_rank
        )

    return cio.save_version(
        path,
        step=step,
        kind="torch",
        prepare=prepare,
        keep=keep,
        origin=origin,
        device=device if device is not None else torch.device("cpu"),
    )


def load_dcp(
    state: dict[str, Any], path: Path, *, device: torch.device | None = None
) -> tuple[dict[str, Any], dict[str, Any] | None, Any]:
    """Collective: load the checkpoint ``path/LATEST`` names into ``state`` in place, after every
    rank has verified its share of the files' checksums; nothing in the files can run code.
    Returns its extra, this rank's own state (None when the checkpoint has none for this rank) and
    the version loaded (an ``Origin``, for the next save). Failures raise ``CheckpointError`` on
    every rank, before ``state`` is touched when the files are at fault."""
    from zeropp.runtime import checkpoint_io as cio

    dev = device if device is not None else torch.device("cpu")
    error, token, d, meta = None, 0, None, None
    try:
        d, meta = cio.locate(path, "torch")
        token = cio.Origin.of(d).token
    except Exception as exc:
        error = cio.describe(exc)
    hint = "Nothing was loaded. Restore or re-create the checkpoint, or resume from another one"
    cio.agree(dev, error, f"load from {path}", hint, token)
    assert d is not None and meta is not None
    cio.read_state(state, d, meta, what=f"load from {path}", hint=hint)
    mine = cio.read_rank_state(d, meta, dist.get_rank())
    return dict(meta.get("extra") or {}), mine, cio.Origin.of(d)


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
    bucket = (
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


def build_trainer(cfg: RunConfig, device: torch.device) -> Trainer:
    """The trainer named by ``cfg.trainer.name``, built by its registered spec's builder (after
    ``dist.init_process_group``)."""
    trainer: Trainer = resolve_builder(TRAINER_SPECS[cfg.trainer.name])(cfg, device)
    return trainer
