"""ZeroEngine: ZeRO stages 0-3 with the ZeRO++ switches, behind one ``train_step``.

Life of a step (``grad_accum_steps`` micro-batches):

1. forward + backward of each micro-batch. Stage 3 gathers blocks on demand (``stage3.py``;
   it also requires every rank to run the same blocks in forward, and checks that). Stages 2
   and 3 reduce-scatter a block's gradient as soon as it is complete, on every micro-step, in
   one fixed order on every rank; stages 0 and 1 reduce once after the last micro-step
   (``reduction.py``, ``self.reducer``).
2. gradients -> fp32 (unscaled for fp16), global norm over all shards (one scalar all-reduce,
   shared with the loss), skip on overflow, clip, AdamW on the fp32 master shards. With
   ``offload_optimizer=cpu`` each unit's final gradient is copied to its host buffer as soon as
   it is reduced (``HostAdamW.land_grad``) and all of this runs on those host buffers
   (``update.py``, ``self.update``, for this step and the next).
3. compute parameters refreshed from the masters: copied (stages 0 and 3) or all-gathered
   (stages 1 and 2); hpZ secondary copies are dropped because they are now stale. With
   ``ZeroConfig.weight_diff`` the ranks instead receive quantized differences from the weights
   they hold: stages 1-2 add them to their replicas, stage 3 to its persistent hpZ secondaries
   (``weight_diff.py``).

Where the state lives: in fp32 without offload the master *is* the parameter (the stage-3 shard,
or this rank's slice of the stage 0-2 flat buffer; not at stages 1-2 with ``weight_diff``, whose
replicas hold approximate weights), so there is no second fp32 copy (16 / 10 / 7 / 4
bytes per parameter for stages 0-3 at 4 ranks). ``offload_optimizer=cpu|nvme`` moves masters and
moments to host memory or swap files and runs AdamW on the CPU; ``offload_param=cpu|nvme`` keeps
the stage-3 parameter shards there between gathers (``offload.py``, ``swap.py``).

ZeRO-R (``activation_checkpointing=True``, ``ZeroConfig.offload_activations``): each block is
checkpointed with torch's non-reentrant ``torch.utils.checkpoint`` (at stage 3 the recomputation
finds the block re-gathered, see ``stage3.py``); every training forward runs under the
``ActivationStore`` hooks (``activations.py``), which keep saved activations on the device or in
(pinned) host memory and count their bytes per tier (``self.activations.memory_by_tier()``).
Gathers and reduce-scatters draw their buffers from one constant pool (``self.buffers``,
``buffers.py``; size ``self.buffers.nbytes``).

The loss of each micro-batch is divided by ``grad_accum_steps`` before backward and gradients
are averaged over ranks, so the update equals single-process training on the global batch.
"""

from __future__ import annotations

import dataclasses
import datetime
import warnings
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from zeropp.comm.stats import CommStats
from zeropp.comm.topology import Topology

from . import frozen as fz
from . import memory as mem
from . import tensor_parallel as tpar
from .activations import ActivationStore, checkpoint_blocks
from .batch import LossFn, control_group
from .blocks import BlockChoiceWarning, BlockPolicy, find_blocks, one_unit_warning
from .collectives import EngineComm
from .config import OptimizerConfig, ZeroConfig, validate_against_topology
from .engine_state import EngineState
from .engine_step import EngineSteps
from .loss_scale import make_loss_scaler
from .offload import HostAdamW, ParamStore, make_optimizer
from .optimizer import KERNELS
from .partition import FlatUnit
from .reduction import GradReducer, reduces_when_ready
from .rollcall import CALL_TIMEOUT, USER_FORWARD, check_timeout, roll_calls
from .stage3 import Stage3Hooks
from .swap import SwapSpace
from .units import assign_homes, build_units, check_persistence_threshold
from .update import ParamUpdate, StepResult
from .weight_diff import WeightDiff
from .wrapped import ModelGuard, check_wrappable

__all__ = ["StepResult", "ZeroEngine"]  # StepResult: what train_step returns, importable from here

if TYPE_CHECKING:  # imported where used: DCP pulls in DTensor and sympy (seconds per process)
    from . import checkpoint as ckpt


class ZeroEngine(EngineSteps, EngineState):
    """Wrap ``model`` for ZeRO ``config.stage`` training with AdamW ``optimizer``.

    Must be created on every rank of an initialised default process group, with the same model
    architecture; rank 0's weights are broadcast so ranks start identical. The model's
    parameters are replaced by views into the engine's buffers (stage 3: empty between uses);
    use :meth:`consolidated_state_dict` to get plain weights back. ``cpu_adam`` picks the AdamW
    kernel (``native``, ``native-exact``, ``exact``, ``fused``, ``foreach`` or ``single``; see
    ``offload.py``). Unset: ``native``, the one-pass C++ kernel, for an offloaded optimizer, and
    ``exact`` (torch's single-tensor bits by the fastest path here, ``optimizer.py``) in memory.
    ``native-exact``, ``exact`` and ``single`` give the same bits as each other; ``fused`` is
    torch's fused kernel. A native kernel for optimizer state on a GPU is refused.

    Any ``nn.Module``: ``blocks`` chooses the blocks (the stage-3 gather units and the stage-2/3
    reduction units), like FSDP's auto-wrap policy: ``None`` (``model.blocks`` if it is a
    ``ModuleList``, else the longest ``ModuleList``, else each child with parameters of an
    ``nn.Sequential`` model), a module class or a list of them, or
    ``callable(qualified_name, module) -> bool``; the outermost matches, in registration order
    (which should be the forward order). A policy that matches nothing is a ``ValueError`` on
    every rank, before any collective. Everything outside the blocks is the root unit, and so is a
    parameter registered in two units (a tied weight: one shard, one gradient, counted once).
    At stage 3 a partition whose one gathered unit holds every trainable parameter warns on rank
    0 (``BlockChoiceWarning``, naming ``blocks=``): it would gather the whole model at once.
    ``ZeroConfig.coalesce_numel`` merges consecutive blocks into one unit up to that many elements
    (fewer, larger collectives; ``blocks.coalesce_spans``).
    A micro-batch is passed to the model as ``model(**mb)`` (a dict), ``model(*mb)`` (a tuple,
    e.g. the GPT's ``(idx, targets)``), ``model(<inputs>)`` (a ``WithTargets(inputs, targets)``,
    whose targets only the loss sees) or ``model(mb)``; the loss is ``loss_fn(output, mb)`` when
    given, else taken from the output (``zeropp.runtime.batch``).

    Tensor parallelism (``topology.tp > 1``): ``model`` must have been split by
    ``zeropp.runtime.tensor_parallel.parallelize(model, make_mesh(topology))``; the engine then
    shards, gathers and reduces each rank's TP-local parameters over the data-parallel ranks that
    share its tp index (``self.world_size`` / ``self.rank`` are that dimension's), the gradient
    norm is the whole model's, :meth:`consolidated_state_dict` returns full (unsplit) weights, and
    checkpoints hold each tp index's pieces (they load at the same tp, any data-parallel size;
    ``export_consolidated`` merges them). Tensor-parallel ranks must be given the same
    micro-batches.

    Frozen parameters (``requires_grad=False``, e.g. a LoRA base model): stages 0-2 keep them
    replicated in the compute dtype on every rank; stage 3 shards them in per-block ``frozen``
    units gathered next to the trainable ones (no gradient, no optimizer state), stored quantized
    once with ``ZeroConfig.quantize_frozen=int8|int4`` (MixZ++, ``frozen.py``; ``self.frozen``).

    ``activation_checkpointing=True`` recomputes each block's activations in backward (the
    engine's blocks that hold trainable parameters); a model without blocks is refused with a
    ``ValueError`` at construction.

    ``comm_timeout``: how long the engine's own waits for a peer (the shared-memory transport of
    ``ZeroConfig.transport`` ``shm``, or ``auto`` resolved to it) last before raising; pass the timeout given to
    ``init_process_group`` (None: torch's default process-group timeout). The backend's collectives
    keep the process group's own. ``call_timeout``: how long the collective calls a user may make on
    some ranks only (``if rank == 0:``) -- :meth:`eval_loss`, :meth:`save_checkpoint`,
    :meth:`load_checkpoint`, :meth:`consolidated_state_dict` -- wait for every rank to call them before
    raising on the ranks that did (``rollcall.py``; a rank that comes after the others gave up raises at
    once; ``eval_loss(..., local=True)`` is this rank's loss alone, at stages 0-2).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        config: ZeroConfig | None = None,
        optimizer: OptimizerConfig | None = None,
        topology: Topology | None = None,
        activation_checkpointing: bool = False,
        blocks: BlockPolicy = None,
        loss_fn: LossFn | None = None,
        cpu_adam: str | None = None,
        comm_timeout: datetime.timedelta | None = None,
        call_timeout: datetime.timedelta = CALL_TIMEOUT,
    ) -> None:
        cfg = config if config is not None else ZeroConfig()
        if not isinstance(cfg, ZeroConfig):
            raise TypeError(f"config must be a ZeroConfig, got {type(cfg).__name__}")
        if cpu_adam is not None and cpu_adam not in KERNELS:
            raise ValueError(f"ZeroEngine cpu_adam={cpu_adam!r} is not a CPU AdamW kernel; use one of {KERNELS}")
        if optimizer is not None and not isinstance(optimizer, OptimizerConfig):
            raise TypeError(
                f"optimizer must be a zeropp.runtime.OptimizerConfig (the engine runs its own sharded AdamW over "
                f"its shards), got {optimizer!r}; e.g. optimizer=OptimizerConfig(lr=3e-4, weight_decay=0.1)"
            )
        check_timeout(call_timeout)  # before any collective
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn={loss_fn!r} is not callable; pass callable(output, micro_batch) -> loss or None")
        block_modules = find_blocks(
            model, blocks
        )  # a bad policy fails here, alike on every rank, before any collective
        check_wrappable(model)  # materialized, trainable, not held by another engine; likewise
        if cfg.stage == 3:
            check_persistence_threshold(model, cfg.persistence_threshold)  # likewise
        self.loss_fn = loss_fn
        """``loss_fn(output, micro_batch) -> loss`` given at construction, or None (loss from the output)."""
        if not dist.is_initialized():
            raise RuntimeError("ZeroEngine needs torch.distributed initialised (dist.init_process_group) on every rank")
        world, rank = dist.get_world_size(), dist.get_rank()
        topo = topology if topology is not None else Topology.single_node(world)
        if cfg.hpz_size is not None:
            topo = dataclasses.replace(topo, hpz_size=cfg.hpz_size)
        validate_against_topology(cfg, world, topo.nodes, topo.ranks_per_node)  # before any allocation
        tpar.check_model_matches(model, topo)  # tp > 1: a model split by tensor_parallel.parallelize
        self.cfg, self.opt_cfg, self.topology = cfg, optimizer or OptimizerConfig(), topo
        self.dtype = cfg.dtype
        self.model = model
        self.comm_stats = CommStats()
        first = next(model.parameters(), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self.comm = EngineComm(topo, self.comm_stats, self.device, transport=cfg.transport, timeout=comm_timeout)
        self.transport = self.comm.transport
        """What carries the ZeRO group's plain collectives (``ZeroConfig.transport`` as requested, as
        resolved and why; ``str()`` reads ``transport=auto -> shm (...)``), the same on every rank."""
        self.comm_session = self.comm.session
        """This engine's communication state (``zeropp.comm.CommSession``): its ``stats`` are
        :attr:`comm_stats`, its ``stochastic`` counter the seed rule's call index (saved with
        checkpoints), ``add_wait_hook`` times its waits. Never shared with another engine."""
        self.world_size, self.rank = self.comm.world_size, self.comm.rank
        """ZeRO's world: the data-parallel ranks (all ranks unless ``topology.tp > 1``) and this rank's index there."""
        self._all_ranks = world  # the default group (tp ranks included): scalar sums, error reports
        self._pg = dist.group.WORLD  # a later destroy_process_group (and init) replaces it: _check_open
        self.param_dtypes: dict[str, torch.dtype] = {
            n: p.dtype for n, p in model.named_parameters(remove_duplicate=False)
        }
        """Parameter name (every name of a tied one) -> dtype in the unwrapped model (what
        ``consolidated_state_dict`` returns)."""
        self.num_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        # the blocks coalesced into one unit each (ZeroConfig.coalesce_numel), trainable and frozen units
        # alike; sized now, before any parameter is sharded
        spans = assign_homes(model, block_modules).spans(cfg.coalesce_numel)

        # Frozen parameters (requires_grad=False) are not trained: rank 0's values are broadcast (ranks
        # start identical, as for the trained ones). Stage 3 shards the floating-point ones in per-block
        # "frozen" units (frozen.py; stored quantized with quantize_frozen=int8|int4, MixZ++). Otherwise
        # (stages 0-2, or under the persistence threshold) they stay replicated, cast to the compute
        # dtype; the originals are kept when the cast rounds, so consolidated_state_dict returns them
        # unrounded, in their dtype (a sharded frozen unit keeps its own shard of them, see frozen.py).
        self.frozen = (
            fz.build_frozen_units(
                model,
                block_modules=block_modules,
                world_size=self.world_size,
                rank=self.rank,
                dtype=self.dtype,
                persistence_threshold=cfg.persistence_threshold,
                spec=fz.frozen_spec(cfg.quantize_frozen, cfg.weights.group_size if cfg.weights else None),
                spans=spans,
            )
            if cfg.stage == 3
            else fz.FrozenUnits()
        )
        """Stage 3: the frozen units (``frozen.FrozenUnits``); empty at stages 0-2."""
        self.frozen_units: list[FlatUnit] = self.frozen.units
        sharded_frozen = self.frozen.param_ids()
        self.frozen_originals: dict[str, torch.Tensor] = {}
        """Replicated frozen parameters whose compute-dtype copy rounds: name -> the unrounded original."""
        for name, p in model.named_parameters():
            if not p.requires_grad and p.is_floating_point():
                data = p.data.contiguous()
                self.comm.broadcast_(data)
                if id(p) in sharded_frozen:
                    p.data = data  # cut into shards below, in the originals' dtype
                    continue
                if data.dtype != self.dtype:
                    self.frozen_originals[name] = data
                p.data = data.to(self.dtype)
        fz.shard_frozen_units(self.frozen)
        self.units, self.blocks, self.root, self.persistent = build_units(
            model,
            stage=cfg.stage,
            world_size=self.world_size,
            rank=self.rank,
            dtype=self.dtype,
            persistence_threshold=cfg.persistence_threshold,
            block_modules=block_modules,
            spans=spans,
        )
        if (
            cfg.stage == 3
            and rank == 0
            and (msg := one_unit_warning(model, blocks, self.units, coalesce_numel=cfg.coalesce_numel))
        ):
            warnings.warn(msg, BlockChoiceWarning, stacklevel=2)  # once, on rank 0: the ranks partition alike
        self._tp_masks = (
            None
            if topo.tp == 1
            else [  # [padded] bool: element of a TP-sharded parameter
                tpar.tp_sharded_mask(u.params, [(sl.offset, sl.numel) for sl in u.slots], u.padded, self.device)
                for u in self.units
            ]
        )
        self.swap = (
            SwapSpace(
                cfg.nvme_path,
                rank,
                buffers=cfg.swap_buffers,
                buffer_size=cfg.swap_buffer_size,
                pin=self.device.type == "cuda",
            )
            if cfg.nvme_path is not None
            else None
        )
        """The nvme tier's swap files and staging buffers (``swap.py``), or None."""
        self.param_store = (
            ParamStore(
                cfg.offload_param, self.units + self.frozen_units, dtype=self.dtype, device=self.device, space=self.swap
            )
            if cfg.stage == 3
            else None
        )
        """Stage 3: where the parameter shards live between gathers (``offload.py``), or None."""
        fz.offload_frozen(self.frozen)  # offload_param=cpu|nvme: the frozen shards go there too
        # fp32 without offload: the master IS the parameter (shard or flat view), no second copy;
        # except stages 1-2 with weight_diff, whose replicas hold approximate weights (weight_diff.py)
        alias = cfg.shares_fp32_master and cfg.offload_optimizer == "none" and cfg.offload_param == "none"
        masters = []
        for u in self.units:
            full = u.flatten_data(torch.float32)  # [padded]
            self.comm.broadcast_(full)
            a, b = u.shard_range()
            if u.kind == "sharded":
                shard = full[a:b].clone()  # [S] fp32
                masters.append(shard)
                self.param_store.put(u, shard if alias else shard.to(self.dtype))
                u.release()
            else:
                flat = full if alias else full.to(self.dtype).clone()
                u.bind(flat)
                masters.append(flat[a:b] if alias else full[a:b].clone())  # [S] fp32 (a view of flat if alias)
            del full
            if reduces_when_ready(cfg.stage, u):
                u.grad_shard = torch.zeros(u.shard_numel, dtype=self.dtype, device=self.device)
        self.buffers = self._make_buffer_pool()
        """The constant pool of gather and reduce-scatter buffers (``buffers.BufferPool``; ``nbytes``)."""
        self._last_memory: dict[str, int] | None = None
        self._memory_sources: dict[str, list[object]] = {c: [] for c in mem.CATEGORIES}
        if self.param_store is not None and self.param_store.tier != "none":
            self.track_memory("params", self.param_store)  # owns the offloaded parameter shards
        if self.swap is not None:
            self.track_memory("buffers", self.swap)  # the nvme tier's staging buffers (host)
        self.track_memory("buffers", self.buffers)
        self._phases: dict[str, mem.MemorySnapshot] = {}
        self._record_phase("model_creation")  # parameters as the stage keeps them; no optimizer state yet
        self.optim = make_optimizer(
            masters, self.opt_cfg, cfg, device=self.device, space=self.swap, masters_are_params=alias, cpu_adam=cpu_adam
        )
        """fp32 masters and Adam moments (``optimizer.py`` / ``offload.py``; ``memory_by_tier()``)."""
        del masters
        self.track_memory("optimizer", self.optim)
        self._land = self.optim.land_grad if isinstance(self.optim, HostAdamW) else None
        """offload_optimizer=cpu: ``land_grad(i, grad)``, each unit's final gradient to the host as soon as it is reduced."""
        # ZeRO-R (activations.py, buffers.py): checkpointing, where saved activations live (the buffer pool: above)
        self.checkpointing = checkpoint_blocks([blk for blk, _ in self.blocks]) if activation_checkpointing else None
        """Activation checkpointing of the engine's blocks (``activations.BlockCheckpointing``) or None."""
        self.activations = ActivationStore(self.device, offload=cfg.offload_activations)
        if topo.tp > 1:  # split weights' aliases in saved DTensor ops are found by storage
            self.activations.storage_params = [p for u in self.units for p in u.params if tpar.is_tp_local(p)]
        """Saved activations of each training forward: tier (device / pinned host) and bytes (``memory_by_tier``)."""
        self._roll_calls = roll_calls(
            ("eval_loss", "save_checkpoint", "load_checkpoint", "consolidated_state_dict")
            + ((USER_FORWARD,) if cfg.stage == 3 else ()),
            timeout=call_timeout,
            device=self.device,
        )
        """Per user-facing collective call: the check that every rank called it, before its
        collectives (``rollcall.py``); None on one rank."""
        self._control = control_group()  # collective; after the steps above that can fail (close() destroys it)
        """The host group of the per-micro-step checks (``batch.control_group``: a gloo group under
        NCCL, else None for the default group)."""
        self._defer_checks = topo.tp == 1 and not any(isinstance(m, nn.SyncBatchNorm) for m in model.modules())
        """Whether the after-forward check may wait for this rank's next collective (``batch.py``): not where
        backward runs collectives of its own (tensor parallelism, ``SyncBatchNorm``)."""
        self.reducer = GradReducer(
            self.units,
            self.blocks,
            self.root,
            self.comm,
            config=cfg,
            pool=self.buffers,
            dtype=self.dtype,
            device=self.device,
            all_ranks=world,
            land=self._land,
            release=(lambda u: self.stage3.release(u)) if cfg.stage == 3 else None,  # self.stage3: built below
            control=self._control,
        )
        """The gradient reduction path (``reduction.py``): reduce order, reduce-scatters in flight, qgZ."""
        self.error_feedback = self.reducer.error_feedback
        """qgZ error-feedback residuals (``zeropp.comm.ErrorFeedback``) or None."""
        self.weight_diff = (
            WeightDiff(
                cfg.weight_diff, self.comm, dtype=self.dtype, device=self.device, bucket=cfg.allgather_bucket_size
            )
            if cfg.weight_diff is not None
            else None
        )
        """qWD: the weight-difference refresh after each step (``weight_diff.py``), or None."""
        self.stage3 = (
            Stage3Hooks(
                model,
                self.blocks,
                self.root,
                self.units + self.frozen_units,
                self.comm,
                config=cfg,
                dtype=self.dtype,
                device=self.device,
                on_block_backward=self.reducer.flush_reductions_before,
                pool=self.buffers,
                weight_diff=self.weight_diff,
                frozen=self.frozen,
                control=self._control,
            )
            if cfg.stage == 3
            else None
        )
        self.scaler = make_loss_scaler(cfg.precision, cfg.loss_scale_init, cfg.loss_scale_window)
        """Dynamic loss scaler for fp16, a static 1.0 otherwise."""
        self.update = ParamUpdate(
            self.units,
            self.optim,
            config=cfg,
            comm=self.comm,
            scaler=self.scaler,
            param_store=self.param_store,
            weight_diff=self.weight_diff,
            landed=self._land is not None,
            tp=topo.tp,
            tp_masks=self._tp_masks,
            world_size=self.world_size,
            all_ranks=world,
            dtype=self.dtype,
            device=self.device,
        )
        """Norm, clip, AdamW and the parameter refresh at the end of each step (``update.py``)."""
        if self.error_feedback is not None:
            self.track_memory("buffers", self.error_feedback)  # qgZ residuals (both hops; 8-bit by default)
        if self.weight_diff is not None:
            self.track_memory("buffers", self.weight_diff)  # stage 3: the references of the hpZ secondaries
        self.track_memory("activations", self.activations)
        self._record_phase("optimizer_creation")  # + the optimizer state, allocated whole here (see memory.PHASES)
        self._checkpoint_origin: ckpt.Origin | None = None
        """The checkpoint this state was last saved to or loaded from: the next save's parent."""
        self.guard = ModelGuard(model, cfg.stage)
        """Refuses ``model.state_dict()`` at stage 3, ``model.load_state_dict()`` and parameters added
        after wrapping, each with what to use instead (``wrapped.py``)."""
        self.guard.park_grads()  # p.grad between steps: one clear error for clip_grad_norm_ and backward
        self._forward_checked = False
        self._forward_hook = (
            model.register_forward_pre_hook(self._check_user_forward, prepend=True)  # before stage 3's gathers
            if self._roll_calls.get(USER_FORWARD) is not None
            else None
        )
        """Stage 3: the roll call of a forward a user makes on some ranks only (``EngineParts._check_user_forward``)."""
        self._closed = False

    def __repr__(self) -> str:
        c = self.cfg
        return (
            f"ZeroEngine(stage={c.stage}, precision={c.precision}, world={self.world_size}, {self.topology}, "
            f"weights={c.weights.label if c.weights else None}, hpz={c.hpz}, "
            f"grads={c.grads.label if c.grads else None}, params={self.num_params})"
        )
