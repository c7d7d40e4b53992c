"""``trainer=deepspeed``: DeepSpeed's ZeRO (stages 0-3) behind the ``trainers.Trainer`` protocol, the
peer a user would pick instead of zeropp, measured by the same runner on the same job.

DeepSpeed is an optional dependency (the ``peers`` extra: ``pip install 'zeropp[peers]'``); this module
is imported only when a rank builds ``trainer=deepspeed`` (the registry names it lazily), and the
config refuses the trainer before any rank starts when DeepSpeed is not installed
(``RunConfig.check_installed``).

What it shares with the other trainers: the model (``trainers.build_model``, same seed), the batches,
torch's ``AdamW`` with the ``optim`` section's settings and the same ``LambdaLR`` schedule
(``torch_trainers.adamw_with_schedule``), ``zero.grad_accum_steps`` and ``zero.grad_clip``. The
optimizer is torch's AdamW, handed to ``deepspeed.initialize`` as a client optimizer, rather than
DeepSpeed's ``DeepSpeedCPUAdam``: its arithmetic is then that of the DDP and FSDP2 trainers, so a
loss drift against DDP measures DeepSpeed's sharding, not a different optimizer kernel, and no C++
extension is compiled when a rank starts (DeepSpeed lists torch's AdamW as supported under ZeRO).

Communication: the runner's gloo (CPU) or NCCL (CUDA) process group is already up when the builder
runs; ``deepspeed.init_distributed`` adopts it instead of starting its own. ``DS_ACCELERATOR`` is set
to the rank's device type before DeepSpeed is first imported (its accelerator is chosen once, at
import), so CPU ranks run on DeepSpeed's CPU accelerator with gloo.

Precision: ``fp32``, or ``bf16`` as DeepSpeed's ``bf16`` mode (bf16 weights and gradients, fp32
master weights in the optimizer). DeepSpeed does not skip a step whose gradient norm is not finite
outside fp16; the norm is reported and the runner's divergence rule stops such a run. Checkpoints are
not implemented for it (the config refuses ``train.checkpoint_every`` and ``resume``).
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import torch
from torch import nn

from .config import RunConfig
from .torch_trainers import TorchTrainer, _maybe_checkpoint, adamw_with_schedule
from .trainers import StepOut, build_model

STEPS_PER_PRINT = 2**31 - 1
"""DeepSpeed's ``steps_per_print``: never (the runner prints its own progress)."""


def ds_config(cfg: RunConfig) -> dict[str, Any]:
    """The DeepSpeed config of a run: its batch sizes, accumulation, clipping, ZeRO stage and precision
    (the optimizer and schedule are client objects, so the config names neither)."""
    z, mbs = cfg.zero, cfg.train.micro_batch_size
    return {
        "train_micro_batch_size_per_gpu": mbs,
        "gradient_accumulation_steps": z.grad_accum_steps,
        "train_batch_size": mbs * z.grad_accum_steps * cfg.world_size,
        "gradient_clipping": float(z.grad_clip or 0.0),
        "zero_optimization": {"stage": z.stage},
        "bf16": {"enabled": z.precision == "bf16"},
        "steps_per_print": STEPS_PER_PRINT,
        "wall_clock_breakdown": False,
    }


def _storages(ts: Any, seen: set[int]) -> int:
    """Bytes of the tensors in ``ts`` whose storage is not in ``seen`` yet (then added): DeepSpeed's
    flat buffers and the views into them are counted once."""
    total = 0
    for t in ts:
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        st = t.untyped_storage()
        if st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        total += st.nbytes()
    return total


def _flat(xs: Any) -> list[Any]:
    """A list of tensors from DeepSpeed's containers (lists of lists, dicts of lists)."""
    if isinstance(xs, dict):
        xs = list(xs.values())
    out: list[Any] = []
    for x in xs or ():
        out.extend(_flat(x) if isinstance(x, (list, tuple, dict)) else [x])
    return out


class DeepSpeedTrainer(TorchTrainer):
    """DeepSpeed's engine in the loop every torch trainer shares: per micro-batch ``engine(idx, tgt)``,
    ``engine.backward``, ``engine.step`` (DeepSpeed divides by the accumulation steps, steps AdamW
    and the schedule at the accumulation boundary, and clips there)."""

    def __init__(self, engine: Any, cfg: RunConfig, opt: Any, sched: Any) -> None:
        self.engine = engine
        super().__init__(engine, cfg, autocast=False, optimizer=(opt, sched))

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> StepOut:
        from zeropp.runtime.batch import call_model, loss_of

        n = len(micro_batches)
        if n != self.cfg.zero.grad_accum_steps:
            raise ValueError(f"got {n} micro-batches but zero.grad_accum_steps={self.cfg.zero.grad_accum_steps}")
        lr = float(self.engine.get_lr()[0])
        total = 0.0
        for i, mb in enumerate(micro_batches):
            loss = loss_of(call_model(self.engine, mb), mb)
            self.engine.backward(loss)
            if i == n - 1:
                self._memory = self._measure_memory()  # at the end of backward, as the other trainers
            self.engine.step()
            total += float(loss.detach().float())
        norm = self.engine.get_global_grad_norm()
        return StepOut(loss=total / n, grad_norm=None if norm is None else float(norm), lr=lr)

    def _measure_memory(self) -> dict[str, int]:
        """Model-state bytes this rank holds, from DeepSpeed's own buffers: the parameters (ZeRO-3's
        local partitions ``ds_tensor``, else the parameters), the gradients (ZeRO-3's flat partition
        buffer, ZeRO-1/2's averaged partitions, the parameters' ``.grad``) and the optimizer (fp32
        master partitions and AdamW's moments). Storages are counted once, so a view into a flat
        buffer adds nothing."""
        zo, seen = self.engine.optimizer, set[int]()
        model_params = list(self.engine.module.parameters())
        params = _storages((getattr(p, "ds_tensor", p) for p in model_params), seen)
        grads = _storages(
            [
                getattr(zo, "grad_partitions_flat_buffer", None),
                *_flat(getattr(zo, "averaged_gradients", None)),
                *(p.grad for p in model_params),
            ],
            seen,
        )
        inner = getattr(zo, "optimizer", zo)
        # ZeRO-3 hands its fp32 partitions to AdamW only for the step, so they are read off its own lists
        masters = [
            *_flat(getattr(zo, "fp32_partitioned_groups_flat", None)),
            *_flat(getattr(zo, "single_partition_of_fp32_groups", None)),
            *(p for g in inner.param_groups for p in g["params"]),
        ]
        optim = _storages([*masters, *(v for s in inner.state.values() for v in s.values())], seen)
        return {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}

    def close(self) -> None:
        """Release the engine (ZeRO-3's hooks and buffers); the process group stays up."""
        self.engine.destroy()

    def save(self, path: Any, extra: dict[str, Any], keep: int) -> None:
        raise NotImplementedError("trainer=deepspeed saves no checkpoints (the config refuses train.checkpoint_every)")

    def load(self, path: Any) -> dict[str, Any]:
        raise NotImplementedError("trainer=deepspeed loads no checkpoints (the config refuses resume=true)")


def build_deepspeed(cfg: RunConfig, device: torch.device) -> DeepSpeedTrainer:
    """``trainer=deepspeed``: DeepSpeed ZeRO at ``stage``, over the runner's process group."""
    # the rank's device decides, not a DS_ACCELERATOR the user's shell may carry for other work
    os.environ["DS_ACCELERATOR"] = "cpu" if device.type == "cpu" else device.type
    import deepspeed
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)  # its INFO lines per rank would drown the runner's output
    # DeepSpeed 0.19 calls torch.distributed's tensor collectives by their deprecated names, and
    # torch warns at every call of every step; the calls are the same collectives, so the warnings go
    for name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        warnings.filterwarnings(
            "ignore", message=rf"`torch\.distributed\.{name}` is deprecated", category=FutureWarning
        )
    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), auto_mpi_discovery=False)
    model: nn.Module = build_model(cfg, device)
    _maybe_checkpoint(model, cfg)
    opt, sched = adamw_with_schedule(model.parameters(), cfg)
    engine, _, _, ds_sched = deepspeed.initialize(
        model=model, optimizer=opt, lr_scheduler=sched, config=ds_config(cfg), dist_init_required=False
    )
    return DeepSpeedTrainer(engine, cfg, opt, ds_sched or sched)
