"""The optimizer step of ``ZeroEngine`` and the refresh of the compute parameters after it.

Why a module of its own: steps 2 and 3 of a training step (``engine.py``'s docstring) are one
piece of logic with one set of inputs -- the reduced gradients, the fp32 masters, the loss scaler
and the places the compute parameters live -- and nothing of the forward or backward hooks. The
engine builds a :class:`ParamUpdate` once and calls :meth:`ParamUpdate.step` at the end of each
``train_step``.

What a step does, identically on every rank:

1. gradients -> fp32 (with ``offload_optimizer=cpu|nvme`` the host buffers they landed in, used in
   place), unscaled for fp16;
2. the global squared norm: one fp64 all-reduce over the default group, shared with the loss
   (sharded units summed over ranks, a replicated unit counted once; with tensor parallelism
   each element weighted so that it counts once over the whole model). The loss and the squares
   stay on the device until this all-reduce, and its result is the one value of the step the
   host reads back (:meth:`ParamUpdate.read_totals`): reading a device value waits for every
   kernel queued before it, so one read per step lets the host queue a whole forward and
   backward ahead of the GPU. The read cannot go later: whether to step (3.) and the clip
   coefficient are decided on the host;
3. a non-finite norm skips the update (fp16 overflow) and tells the loss scaler; else clip as
   ``torch.nn.utils.clip_grad_norm_`` does and run AdamW on the masters, refreshing each unit's
   compute parameters as soon as its master is updated (with a CPU optimizer the copy back
   overlaps the next unit's update);
4. the refresh per unit kind: a replicated unit copies its master into its flat buffer; a stage-3
   shard goes to its ``ParamStore`` (and with ``weight_diff`` the hpZ secondary receives
   quantized differences); stages 1-2 all-gather the updated shards (or their quantized
   differences with ``weight_diff``), asynchronously, in unit order on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from zeropp.comm import ranges
from zeropp.comm.backend import control_all_reduce
from zeropp.comm.kinds import CommKind

from .batch import CONTROL_RANGE
from .collectives import EngineComm
from .config import ZeroConfig
from .loss_scale import LossScaler
from .offload import ParamStore
from .partition import FlatUnit
from .weight_diff import WeightDiff


@dataclass
class StepResult:
    """What one ``train_step`` did (identical on every rank)."""

    loss: float
    """Mean loss over the global batch (all micro-batches, all ranks)."""
    grad_norm: float
    """Global gradient norm before clipping (nan/inf when the step was skipped)."""
    skipped: bool
    """True when the gradient was not finite and no update was made (fp16 overflow)."""
    comm_wait_s: float = 0.0
    """Seconds this rank was blocked on communication. CUDA: the compute stream's stalls waiting
    for the communication streams and synchronous collectives, measured with timing events on the
    GPU. CPU: host time of waits, synchronous calls and quantization at issue (``streams.py``)."""
    step_time_s: float = 0.0
    """Wall time of the whole step on this rank."""
    loss_scale: float = 1.0
    """fp16 loss scale used for this step (1.0 otherwise)."""
    lr: float = 0.0
    """Learning rate of this step's update (``OptimizerConfig.lr_at(steps taken before it)``); a
    skipped step makes no update and does not advance the schedule."""
    memory: dict[str, int] = field(default_factory=dict)
    """Model-state bytes this rank held during the step (see ``memory_report``)."""


class ParamUpdate:
    """Norm, clip, AdamW and parameter refresh for the engine's trainable ``units``.

    ``optim`` holds one fp32 master per unit (``optimizer.py`` / ``offload.py``); ``landed`` is
    True when gradients land in the optimizer's host buffers (``HostAdamW.land_grad``), so
    :meth:`step` uses those instead of the ones it is given. ``tp_masks`` (tensor parallelism
    only): per unit, ``[padded]`` bool, True where an element belongs to a TP-sharded parameter.
    ``world_size`` is the data-parallel world, ``all_ranks`` the default group's size."""

    def __init__(
        self,
        units: Sequence[FlatUnit],
        optim,
        *,
        config: ZeroConfig,
        comm: EngineComm,
        scaler: LossScaler,
        param_store: ParamStore | None,
        weight_diff: WeightDiff | None,
        landed: bool,
        tp: int,
        tp_masks: list[torch.Tensor] | None,
        world_size: int,
        all_ranks: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.units, self.optim, self.cfg, self.comm, self.scaler = list(units), optim, config, comm, scaler
        self.param_store, self.weight_diff, self.landed = param_store, weight_diff, landed
        self.tp, self.tp_masks = tp, tp_masks
        self._masks: dict[tuple[int, str], torch.Tensor] = {}  # (unit, device) -> the mask of what this rank holds
        self.world_size, self.all_ranks, self.dtype, self.device = world_size, all_ranks, dtype, device

    def step(
        self,
        grads: list[torch.Tensor],
        local_loss: torch.Tensor,
        memory: dict[str, int] | None,
        *,
        late: int = 0,
        on_late: Callable[[], None] | None = None,
    ) -> StepResult:
        """Collective. ``grads``: per unit, this rank's reduced gradient in the compute dtype
        (``[S]`` shard or ``[padded]`` flat); ``local_loss``: this rank's mean micro-batch loss, a
        0-dim fp64 tensor on the engine's device (not read here: see :meth:`read_totals`).
        ``late``: this rank's count of gradients that arrived too late
        (``reduction.GradReducer.late_grads``), summed over the ranks in the all-reduce of the
        loss and norm; when the sum is not 0, ``on_late()`` runs on every rank before anything is
        updated (it raises: ``GradReducer.raise_late_grads``). One all-reduce fewer per step than
        a check of its own.

        ``grads`` are this step's own buffers (``GradReducer.final_grads``: new tensors, or the
        stage 2-3 gradient shards, which the next step's first reduction overwrites), so fp32 ones are unscaled and clipped in place
        rather than through a copy."""
        scale = self.scaler.scale
        g32 = (
            self.optim.landed_grads() if self.landed else [g if g.dtype == torch.float32 else g.float() for g in grads]
        )
        if scale != 1.0:
            for g in g32:
                g.div_(scale)
        loss_tot, sq_tot, sq_repl, late_tot = self.read_totals(local_loss, g32, late=late)
        if late_tot and on_late is not None:  # the same sum on every rank: all of them raise here
            on_late()
        norm = math.sqrt(sq_tot + sq_repl) if math.isfinite(sq_tot + sq_repl) else float("nan")
        res = StepResult(
            loss=loss_tot / self.all_ranks,
            grad_norm=norm,
            skipped=not math.isfinite(norm),
            comm_wait_s=0.0,
            loss_scale=scale,
            lr=self.optim.lr,
            memory=dict(memory or {}),
        )
        self.scaler.update(finite=not res.skipped)
        if not res.skipped:
            if self.cfg.grad_clip is not None:
                coef = min(self.cfg.grad_clip / (norm + 1e-6), 1.0)  # as torch.nn.utils.clip_grad_norm_
                for g in g32:
                    g.mul_(coef)
            works: list = []
            self.optim.step(g32, on_updated=lambda i: self._refresh_unit(i, works))
            for w in works:
                w.wait()
        for u in self.units:  # (the gradient shards need no zero-fill: the next step's first reduction writes them)
            if self.weight_diff is None:
                u.secondary = None  # stale after the step (hpZ); with weight_diff refreshed in _refresh_unit
        res.comm_wait_s = self.comm.wait_s
        return res

    def read_totals(
        self, local_loss: torch.Tensor, g32: list[torch.Tensor], *, late: int = 0
    ) -> tuple[float, float, float, float]:
        """``(loss summed over all ranks, squared norm of the sharded units summed over all ranks,
        squared norm of the replicated units, late summed over all ranks)``: the squares are summed on the device where the
        gradients are (fp32 per unit, accumulated in fp64 in unit order, as Python floats were),
        the first two all-reduced together with the loss, and the three read back at once -- the
        step's only device-to-host read. Collective."""
        dev = local_loss.device
        where = g32[0].device if g32 else dev  # the engine's device, or the host with a CPU optimizer
        sq_sharded = torch.zeros((), dtype=torch.float64, device=where)
        sq_repl = torch.zeros((), dtype=torch.float64, device=where)
        if self.tp_masks is None:
            for g, u in zip(g32, self.units):
                sq = g.pow(2).sum().double()
                if u.kind == "replicated":
                    sq_repl += sq
                else:
                    sq_sharded += sq
        else:
            sq_sharded = self._tp_squares(g32)
        # host sums (CPU optimizer) join the loss on the device without a wait: non_blocking from host memory
        vec = torch.stack(
            [
                local_loss.to(torch.float64),
                sq_sharded.to(dev, non_blocking=True),
                torch.full((), float(late), dtype=torch.float64, device=dev),  # a fill on the device: no copy, no wait
                sq_repl.to(dev, non_blocking=True),
            ]
        )  # [4] fp64 on the device
        if self.all_ranks > 1:
            with self.comm.streams.blocked(), ranges.span(CONTROL_RANGE):  # control traffic: not in the byte accounting
                # loss, sharded squares, late counts summed; the replicated squares counted once
                control_all_reduce(vec[:3], "sum")
        loss_tot, sq_tot, late_tot, sq_r = vec.tolist()  # the one read: waits for the GPU to finish the backward
        return loss_tot, sq_tot, sq_r, late_tot

    @torch.no_grad()
    def refresh_all(self) -> None:
        """Rebuild every unit's compute parameters from its master, exactly (after a load). Collective."""
        works: list = []
        for i in range(len(self.units)):
            self._refresh_unit(i, works, exact=True)
        for w in works:
            w.wait()

    def master_copy(self, i: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A copy of master ``i`` in ``dtype`` on the engine's device ([S]; read back if offloaded)."""
        m = torch.empty(self.optim.numels[i], dtype=dtype, device=self.device)
        self.optim.copy_master_to(i, m)
        return m

    def _refresh_unit(self, i: int, works: list, exact: bool = False) -> None:
        """Refresh unit ``i``'s compute parameters from master ``i``; stages 1/2 (and stage 3 with
        ``weight_diff``) append the async all-gather to ``works`` (issued in unit order on every
        rank). ``exact=False`` with ``weight_diff``: send quantized weight differences."""
        u = self.units[i]
        wd = self.weight_diff
        if u.kind == "replicated":
            self.optim.copy_master_to(i, u.flat)  # nothing to do when the master is the flat (fp32)
        elif u.kind == "sharded":
            self.param_store.update(u, self.optim, i)
            if wd is not None and not exact and wd.has_secondary(u):
                works.append(wd.refresh_secondary(u, self.master_copy(i)))
            else:
                u.secondary = None
                if wd is not None:
                    wd.drop(u)
        elif wd is not None and not exact:  # stages 1/2 with weight_diff: quantized differences
            works.append(wd.refresh_replica(u, self.master_copy(i)))
        else:  # stages 1/2: everyone needs every updated shard
            m = self.master_copy(i, self.dtype)  # [S] (not a view of u.flat)
            works.append(
                self.comm.all_gather(
                    u.flat,
                    m,
                    spec=None,
                    bucket=self.cfg.allgather_bucket_size,
                    kind=CommKind.PARAM_ALL_GATHER,
                    unit=u.name,
                    async_op=True,
                )
            )

    def _tp_squares(self, g32: list[torch.Tensor]) -> torch.Tensor:
        """tp > 1: this rank's share of the whole model's squared gradient norm (0-dim fp64 where
        the gradients are), to be summed over all ranks: a TP-sharded element counts once per tp
        rank (each holds its own part), a TP-replicated one 1/tp (all tp ranks hold it); a
        replicated unit (identical on the dp ranks) is further divided by the dp size. Masked
        with ``torch.where`` (boolean indexing would read the selected count back to the host)."""
        total = torch.zeros((), dtype=torch.float64, device=g32[0].device)
        for i, (g, u) in enumerate(zip(g32, self.units)):
            mask = self._tp_mask(i, g.device)  # [S] or [padded] bool
            sq = g.pow(2)
            part = torch.where(mask, sq, 0.0).sum().double() + torch.where(mask, 0.0, sq).sum().double() / self.tp
            total += part / self.world_size if u.kind == "replicated" else part
        return total

    def _tp_mask(self, i: int, device: torch.device) -> torch.Tensor:
        """Unit ``i``'s TP-sharded mask over what this rank holds of it (its shard, or the whole
        replicated unit) on ``device``; copied there once (a CPU optimizer's gradients are on the host)."""
        key = (i, str(device))
        if key not in self._masks:
            u, mask = self.units[i], self.tp_masks[i]  # [padded] bool
            if u.kind != "replicated":
                a, b = u.shard_range()
                mask = mask[a:b]  # [S]
            self._masks[key] = mask.to(device)
        return self._masks[key]
