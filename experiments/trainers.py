"""One interface over the training stacks a run can compare.

``trainer=zeropp`` is zeropp's ZeroEngine (stages 0-3 with qwZ/hpZ/qgZ switches); ``fsdp2`` is
PyTorch's ``fully_shard`` on every block and the root; ``fsdp2_zeropp`` is the same with zeropp's
collectives plugged into FSDP2; ``ddp`` is DistributedDataParallel, ``ddp_zeropp`` DDP with
zeropp's quantized gradient all-reduce hook. The runner only sees :class:`Trainer`, so metrics,
memory and communication are measured the same way for all of them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol

import torch
import torch.nn as nn

from .config import RunConfig

@dataclasses.dataclass(frozen=True, kw_only=True)
class StepOut:
    """What one optimizer step reports."""

    loss: float
    """Mean training loss over this rank's micro-batches."""
    grad_norm: float | None = None
    """Global gradient norm before clipping, when the trainer computes it."""
    skipped: bool = False
    """True when the step was skipped (non-finite gradients)."""
    comm_wait_s: float | None = None
    """The trainer's own measure of time blocked on communication, when it has one (ZeroEngine)."""


class Trainer(Protocol):
    """What the runner needs from a training stack."""

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> StepOut: ...
    def eval_loss(self, idx: torch.Tensor, targets: torch.Tensor) -> float: ...
    def memory_report(self) -> dict[str, int]: ...
    def comm_stats(self) -> dict[str, int] | None: ...
    def close(self) -> None: ...


def build_model(cfg: RunConfig, device: torch.device) -> nn.Module:
    """The GPT of ``cfg.model`` on ``device``; identical on every rank (seeded)."""
    from zeropp.models import GPT, GPTConfig

    m = cfg.model
    gcfg = GPTConfig(vocab_size=m.vocab_size, seq_len=m.seq_len, d_model=m.d_model, n_layers=m.n_layers,
                     n_heads=m.n_heads, mlp_ratio=m.mlp_ratio)
    torch.manual_seed(cfg.train.seed)
    return GPT(gcfg).to(device)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _bytes(ts: Any) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in ts if isinstance(t, torch.Tensor))


def torch_memory_report(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Model-state bytes held by this rank: local parameter/gradient shards and optimizer state."""
    params = _bytes(model.parameters())
    grads = _bytes(p.grad for p in model.parameters() if p.grad is not None)
    optim = _bytes(v for s in opt.state.values() for v in s.values())
    return {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}


def _blocks(model: nn.Module, n_layers: int) -> list[nn.Module]:
    """The transformer blocks (``model.blocks``, or any ModuleList with n_layers entries)."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList) and len(blocks) == n_layers:
        return list(blocks)
    for mod in model.modules():
        if isinstance(mod, nn.ModuleList) and len(mod) == n_layers:
            return list(mod)
    raise RuntimeError(f"could not find the {n_layers} transformer blocks (an nn.ModuleList) in the model")


class TorchTrainer:
    """Shared loop for FSDP2 and DDP: accumulate, clip, AdamW step."""

    def __init__(self, model: nn.Module, cfg: RunConfig, *, autocast: bool) -> None:
        self.model = model
        self.cfg = cfg
        self.autocast = autocast
        self.opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)

    def _forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        dev = idx.device.type
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=self.autocast):
            _, loss = self.model(idx, targets)
        return loss

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> StepOut:
        total = 0.0
        n = len(micro_batches)
        for i, (idx, tgt) in enumerate(micro_batches):
            sync = getattr(self.model, "no_sync", None) if i < n - 1 else None
            ctx = sync() if sync is not None and callable(sync) else _null()
            with ctx:
                loss = self._forward(idx, tgt)
                (loss / n).backward()
            total += float(loss.detach())
        clip = self.cfg.train.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip if clip > 0 else float("inf"))
        norm_f = float(_local(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return StepOut(loss=total / n, grad_norm=norm_f)

    @torch.no_grad()
    def eval_loss(self, idx: torch.Tensor, targets: torch.Tensor) -> float:
        was = self.model.training
        self.model.eval()
        try:
            return float(self._forward(idx, targets))
        finally:
            self.model.train(was)

    def memory_report(self) -> dict[str, int]:
        return torch_memory_report(self.model, self.opt)

    def comm_stats(self) -> dict[str, int] | None:
        return None

    def close(self) -> None:
        pass


class _null:
    def __enter__(self) -> None: ...
    def __exit__(self, *a: object) -> None: ...


def _stats_dict(stats: Any) -> dict[str, int] | None:
    """``CommStats.snapshot()`` flattened to ``{"<kind>.<link>": bytes}``."""
    if stats is None:
        return None
    snap = stats.snapshot() if hasattr(stats, "snapshot") else dict(stats)
    out: dict[str, int] = {}

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), x)
        elif isinstance(v, (int, float)):
            out[prefix] = int(v)

    for k, v in snap.items():
        walk(".".join(map(str, k)) if isinstance(k, tuple) else str(k), v)
    return out


def zero_config(cfg: RunConfig) -> Any:
    """The ``zeropp.runtime.ZeroConfig`` of a run (its own checks run here)."""
    from zeropp.runtime import ZeroConfig

    z = cfg.zero.effective()
    fields = {f.name: getattr(z, f.name) for f in dataclasses.fields(z)}
    return ZeroConfig(**fields, precision=cfg.train.precision, grad_accum_steps=cfg.train.grad_accum,
                      grad_clip=cfg.train.grad_clip if cfg.train.grad_clip > 0 else None)


class ZeroTrainer:
    """zeropp.runtime.ZeroEngine behind the Trainer interface."""

    def __init__(self, cfg: RunConfig, device: torch.device, topology: Any) -> None:
        from zeropp.runtime import OptimizerConfig, ZeroEngine

        z = cfg.zero.effective()
        zcfg = zero_config(cfg)
        ocfg = OptimizerConfig(lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
        self.engine = ZeroEngine(build_model(cfg, device), config=zcfg, optimizer=ocfg, topology=topology)

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> StepOut:
        r = self.engine.train_step(micro_batches)
        gn = getattr(r, "grad_norm", None)
        cw = getattr(r, "comm_wait_s", None)
        return StepOut(loss=float(r.loss), grad_norm=None if gn is None else float(gn),
                       skipped=bool(getattr(r, "skipped", False)), comm_wait_s=None if cw is None else float(cw))

    def eval_loss(self, idx: torch.Tensor, targets: torch.Tensor) -> float:
        return float(self.engine.eval_loss(idx, targets))

    def memory_report(self) -> dict[str, int]:
        return {k: int(v) for k, v in dict(self.engine.memory_report()).items()}

    def comm_stats(self) -> dict[str, int] | None:
        return _stats_dict(getattr(self.engine, "comm_stats", None))

    def close(self) -> None:
        self.engine.close()


def _fsdp2(cfg: RunConfig, device: torch.device, topology: Any, zeropp_comms: bool) -> TorchTrainer:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build_model(cfg, device)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if cfg.train.precision == "bf16" else MixedPrecisionPolicy()
    raf = cfg.trainer.reshard_after_forward
    for block in _blocks(model, cfg.model.n_layers):
        fully_shard(block, mp_policy=mp, reshard_after_forward=raf)
    fully_shard(model, mp_policy=mp, reshard_after_forward=raf)
    t = TorchTrainer(model, cfg, autocast=False)
    if zeropp_comms:
        from . import plugins

        t.stats = plugins.install_fsdp_comms(model, cfg, topology)  # type: ignore[attr-defined]
        t.comm_stats = lambda: _stats_dict(t.stats)  # type: ignore[method-assign]
    return t


def _ddp(cfg: RunConfig, device: torch.device, topology: Any, zeropp_hook: bool) -> TorchTrainer:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build_model(cfg, device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if not zeropp_hook:
        # The stock all-reduce, but issued from Python so CommWatch sees its bytes (DDP's default
        # reducer calls the C++ collective directly). Same arithmetic as DDP's built-in path.
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        ddp.register_comm_hook(None, allreduce_hook)
    t = TorchTrainer(ddp, cfg, autocast=cfg.train.precision == "bf16")
    if zeropp_hook:
        from . import plugins

        t.stats = plugins.install_ddp_hook(ddp, cfg, topology)  # type: ignore[attr-defined]
        t.comm_stats = lambda: _stats_dict(t.stats)  # type: ignore[method-assign]
    return t


BUILDERS: dict[str, Callable[[RunConfig, torch.device, Any], Trainer]] = {
    "zeropp": lambda c, d, t: ZeroTrainer(c, d, t),
    "fsdp2": lambda c, d, t: _fsdp2(c, d, t, False),
    "fsdp2_zeropp": lambda c, d, t: _fsdp2(c, d, t, True),
    "ddp": lambda c, d, t: _ddp(c, d, t, False),
    "ddp_zeropp": lambda c, d, t: _ddp(c, d, t, True),
}


def build_trainer(cfg: RunConfig, device: torch.device, topology: Any) -> Trainer:
    """The trainer named by ``cfg.trainer.name``; ``topology`` is a zeropp.comm.Topology."""
    return BUILDERS[cfg.trainer.name](cfg, device, topology)
