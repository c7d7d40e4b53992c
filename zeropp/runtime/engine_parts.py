"""What every role of ``ZeroEngine`` reads: the engine's parts, declared once, and its open check.

``ZeroEngine`` (``engine.py``) builds these parts in its constructor and is assembled from role
classes, one per module: the training step and evaluation (``engine_step.py``), the checkpoint
and state-dict side (``engine_state.py``) and the memory accounting (``engine_memory.py``). Each
role derives from :class:`EngineParts`, which only declares the attributes the constructor sets
(so each role's code is type-checked against them) and holds the one check every public entry
point runs first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from zeropp.comm.session import CommSession
from zeropp.comm.stats import CommStats
from zeropp.comm.topology import Topology

from . import frozen as fz
from . import memory as mem
from .activations import ActivationStore, BlockCheckpointing
from .batch import LossFn
from .buffers import BufferPool
from .collectives import EngineComm
from .config import OptimizerConfig, ZeroConfig
from .loss_scale import DynamicLossScaler, StaticLossScaler
from .offload import ParamStore, SwappedAdamW
from .optimizer import ShardedAdamW
from .partition import FlatUnit
from .reduction import GradReducer
from .rollcall import USER_FORWARD, RollCall
from .stage3 import Stage3Hooks
from .swap import SwapSpace
from .update import ParamUpdate
from .weight_diff import WeightDiff
from .wrapped import ModelGuard

if TYPE_CHECKING:
    from .checkpoint_io import Origin


class EngineParts:
    """The attributes ``ZeroEngine.__init__`` sets (documented there), typed for the role classes."""

    cfg: ZeroConfig
    opt_cfg: OptimizerConfig
    topology: Topology
    dtype: torch.dtype
    device: torch.device
    model: nn.Module
    loss_fn: LossFn | None
    comm: EngineComm
    comm_stats: CommStats
    comm_session: CommSession
    world_size: int
    rank: int
    param_dtypes: dict[str, torch.dtype]
    num_params: int
    frozen: fz.FrozenUnits
    frozen_units: list[FlatUnit]
    frozen_originals: dict[str, torch.Tensor]
    units: list[FlatUnit]
    blocks: list[tuple[nn.Module, FlatUnit]]
    root: FlatUnit | None
    swap: SwapSpace | None
    param_store: ParamStore | None
    buffers: BufferPool
    optim: ShardedAdamW | SwappedAdamW
    checkpointing: BlockCheckpointing | None
    activations: ActivationStore
    reducer: GradReducer
    error_feedback: object | None
    weight_diff: WeightDiff | None
    stage3: Stage3Hooks | None
    scaler: DynamicLossScaler | StaticLossScaler
    update: ParamUpdate
    guard: ModelGuard

    _all_ranks: int
    _pg: object
    _control: dist.ProcessGroup | None
    _roll_calls: dict[str, RollCall | None]
    _forward_checked: bool
    _forward_hook: RemovableHandle | None
    _defer_checks: bool
    _last_memory: dict[str, int] | None
    _memory_sources: dict[str, list[object]]
    _phases: dict[str, mem.MemorySnapshot]
    _checkpoint_origin: Origin | None
    _closed: bool

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this ZeroEngine was closed; create a new one")
        if not dist.is_initialized() or self._pg is not dist.group.WORLD:
            raise RuntimeError(
                "the process group this ZeroEngine was built on was destroyed (destroy_process_group); its "
                "groups are gone: after a new init_process_group, build a new model and a new ZeroEngine"
            )

    def _check_every_rank_called(self, what: str) -> None:
        """The roll call of the user-facing collective ``what`` (``rollcall.py``; none on one rank)."""
        self._forward_checked = False  # an engine call: the next forward of the user's own is checked again
        if (roll_call := self._roll_calls[what]) is not None:
            roll_call.check()

    def _check_user_forward(self, module: nn.Module, args: object) -> None:
        """Stage 3, a pre-hook of the model's forward, before stage 3's own: the first forward a user
        makes outside ``train_step`` / ``eval_loss`` after each engine call gets the roll call (a
        forward gathers every block from every rank, so ``if rank == 0: engine.model(x)`` would wait
        in the first gather for the group's timeout); the forwards after it are not checked (a roll
        call per forward would add a store round trip to each)."""
        if self.guard.busy or self._forward_checked:
            return
        self._check_every_rank_called(USER_FORWARD)
        self._forward_checked = True
