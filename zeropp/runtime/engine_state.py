"""The state side of ``ZeroEngine``: checkpoints, the consolidated weights, and closing.

``save_checkpoint`` / ``load_checkpoint`` go through ``torch.distributed.checkpoint``
(``checkpoint.py``: any world size and stage from the same model); ``consolidated_state_dict``
all-gathers the fp32 masters into a plain ``state_dict`` of the unwrapped model; ``close`` drops
the engine's hooks and buffers. Each public method here is collective except ``close``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from zeropp.comm.kinds import CommKind

from . import frozen as fz
from . import tensor_parallel as tpar
from .engine_parts import EngineParts
from .partition import FlatUnit

if TYPE_CHECKING:  # imported where used: DCP pulls in DTensor and sympy (seconds per process)
    from . import checkpoint as ckpt


class EngineState(EngineParts):
    """``ZeroEngine``'s checkpoints, consolidated weights and ``close`` (see the module docstring)."""

    def save_checkpoint(self, path: str | os.PathLike, extra: dict | None = None, *, keep: int = 2) -> str:
        """Atomically save this engine's state under directory ``path`` through
        ``torch.distributed.checkpoint``, with ``extra`` (small JSON values, e.g. the runner's step
        and data position) returned by the load, in a folder named by ``extra["step"]`` (else the
        optimizer's step count). Keeps this run's ``keep`` newest checkpoints there and never
        touches anything else. Refuses NaN/inf weights. Returns the version directory. Collective:
        a rank that waited ``call_timeout`` (``ZeroEngine``) for the others raises before anything
        is written or sent (``rollcall.py``), as under ``if rank == 0:``."""
        self._check_open()
        self._check_every_rank_called("save_checkpoint")
        from . import checkpoint as ckpt

        self._checkpoint_origin = ckpt.save(
            self._checkpoint_target(), path, extra, keep=keep, origin=self._checkpoint_origin
        )
        return str(self._checkpoint_origin.path)

    @torch.no_grad()
    def load_checkpoint(self, path: str | os.PathLike) -> dict:
        """Load the latest complete checkpoint under ``path``, saved at any world size and stage
        from the same model; returns the ``extra`` it was saved with. Collective: a rank that waited
        ``call_timeout`` (``ZeroEngine``) for the others raises before anything is read or sent
        (``rollcall.py``), as under ``if rank == 0:``. The qgZ error-feedback residuals and this
        engine's stochastic-rounding call counter come back too (residuals only at the saving world
        size, stage and topology; see ``checkpoint.py``)."""
        self._check_open()
        self._check_every_rank_called("load_checkpoint")
        from . import checkpoint as ckpt

        extra, model_state, origin = ckpt.load(self._checkpoint_target(gather_frozen=False), path)
        named = dict(self.model.named_parameters())
        buffers = dict(self.model.named_buffers())
        frozen_names = {s.name for u in self.frozen_units for s in u.slots}
        fz.load_values(self.frozen, {k: v for k, v in model_state.items() if k in frozen_names})
        for k, v in model_state.items():
            if k in frozen_names:
                continue
            if k in self.frozen_originals:
                self.frozen_originals[k].copy_(v)
            if k in named:
                named[k].data.copy_(v)
            else:
                buffers[k].copy_(v)
        for u in self.units:
            u.secondary = None  # hpZ: stale, built from the weights before the load
            if u.grad_shard is not None:
                u.grad_shard.zero_()
        self.refresh_params()
        self._checkpoint_origin = origin
        return extra

    @torch.no_grad()
    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 weights as a plain ``state_dict`` for the unwrapped model, on every rank
        (parameters in their original dtype, on the CPU). Collective. With ``topology.tp > 1``
        the split weights are also all-gathered over tp, under the unsplit model's names. A rank
        that waited ``call_timeout`` (``ZeroEngine``) for the others raises before anything is sent
        (``rollcall.py``), as under ``if rank == 0:``."""
        self._check_open()
        self._check_every_rank_called("consolidated_state_dict")

        def gather(u: FlatUnit, m: torch.Tensor) -> torch.Tensor:
            full = torch.empty(u.padded, dtype=torch.float32, device=m.device)  # [padded]
            self.comm.all_gather(
                full,
                m,
                spec=None,
                bucket=self.cfg.allgather_bucket_size,
                kind=CommKind.CHECKPOINT,
                unit=u.name,
                async_op=False,
            )
            return full

        frozen_values = fz.full_values(self.comm, self.frozen, self.param_dtypes, bucket=self.cfg.allgather_bucket_size)
        from .consolidate import consolidated_state_dict

        with self.guard.own_use():  # its model.state_dict() at stage 3: the empty shards, replaced here
            sd = consolidated_state_dict(
                self.units,
                self.update.master_copy,
                gather,
                self.model,
                self.param_dtypes,
                {**self.frozen_originals, **frozen_values},
            )
        return sd if self.topology.tp == 1 else tpar.full_state_dict(self.model, sd)  # tp: all-gathered over tp

    def close(self) -> None:
        """Remove all hooks and drop buffers. Local (no collective), safe to call twice."""
        if self._closed:
            return
        self.reducer.close()  # hooks removed, reduce-scatters in flight waited
        if self._forward_hook is not None:
            self._forward_hook.remove()
        self.guard.remove()
        if self.stage3 is not None:
            self.stage3.release_all()
            self.stage3.remove()
        if self.checkpointing is not None:
            self.checkpointing.remove()
        for u in self.units + self.frozen_units:
            u.secondary = u.grad_shard = None
        if self.weight_diff is not None:
            self.weight_diff.reset()
        if self.swap is not None:
            self.swap.close()  # deletes this rank's swap files
        self.comm.close()  # unmaps the shared-memory region now, not at the next cycle collection
        if self._control is not None and dist.is_initialized():  # (the default group's end destroyed it already)
            dist.destroy_process_group(self._control)
        self._control = None
        self._closed = True

    def _checkpoint_target(self, *, gather_frozen: bool = True) -> ckpt.CheckpointTarget:
        """``gather_frozen``: the sharded frozen parameters' full values (collective); False: empty
        tensors of their shapes and dtypes (enough for a load)."""
        sharded_frozen = self.frozen.param_ids()
        model_state = {
            n: self.frozen_originals.get(n, p.data)
            for n, p in self.model.named_parameters()
            if not p.requires_grad and p.is_floating_point() and id(p) not in sharded_frozen
        }
        if gather_frozen:
            model_state.update(
                fz.full_values(self.comm, self.frozen, self.param_dtypes, bucket=self.cfg.allgather_bucket_size)
            )
        else:
            model_state.update(
                {
                    s.name: torch.empty(s.shape, dtype=self.param_dtypes[s.name])
                    for u in self.frozen_units
                    for s in u.slots
                }
            )
        model_state.update(dict(self.model.named_buffers()))
        from . import checkpoint as ckpt

        return ckpt.CheckpointTarget(
            layouts=[u.layout for u in self.units],
            optimizer=self.optim,
            scaler=self.scaler,
            rank=self.rank,
            world_size=self.world_size,
            device=self.device,
            stage=self.cfg.stage,
            param_dtypes=self.param_dtypes,
            model_state=model_state,
            info={"config": repr(self.cfg), "topology": repr(self.topology)},
            feedback=self.error_feedback,  # restored by the load at the same world / stage / topology, else reset
            stochastic=self.comm_session.stochastic,
            **self._tp_checkpoint_args(),
        )

    def _tp_checkpoint_args(self) -> dict[str, Any]:
        """``topology.tp > 1``: each tp index saves its own TP-local pieces, sharded over the dp
        dimension of the model's mesh (``checkpoint.py``); nothing extra otherwise."""
        info = tpar.tp_info(self.model)
        if info is None:
            return {}
        return dict(
            tp=info.tp,
            tp_rank=self.topology.tp_index(dist.get_rank()),
            mesh=info.mesh["dp"],
            tp_split=tpar.split_table(self.model),
        )

    @torch.no_grad()
    def refresh_params(self) -> None:
        """Rebuild compute-dtype parameters from the fp32 masters (after a load). Exact: with
        ``weight_diff`` the weights are sent whole (stages 1-2) or the hpZ secondaries and their
        references are dropped, to be rebuilt by the next training forward (stage 3). Collective."""
        self.update.refresh_all()
        self.guard.settle()  # the parameters are the masters' again (wrapped.py: writes outside the engine)
