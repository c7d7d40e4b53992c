"""Configuration of the ZeRO runtime.

Both dataclasses are frozen and keyword-only so a config is a value: it can be logged, hashed,
compared across a sweep and never mutated halfway through training. Every check that can be made
without a process group runs in ``__post_init__``, so a bad setting fails before any process
group, buffer or collective exists; checks that need the world (hpZ size vs ranks per node,
divisibility of the world) run in :func:`validate_against_topology`, which the engine calls
before it allocates anything.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from zeropp.comm.choices import StrChoice
from zeropp.comm.spec import QuantRecipe, QuantSpec

from .choices import DEFAULT_TRANSPORT, OffloadTier, Precision, QuantizeFrozen, Schedule, Transport

_DTYPES = {Precision.fp32: torch.float32, Precision.bf16: torch.bfloat16, Precision.fp16: torch.float16}
SCHEDULES = Schedule.values()
OFFLOAD_TIERS = OffloadTier.values()
QUANTIZE_FROZEN = QuantizeFrozen.values()
"""``ZeroConfig.quantize_frozen`` choices: MixZ++'s storage of frozen stage-3 shards."""


def _choice(obj: object, name: str, choice: type[StrChoice], message: str) -> None:
    """Store field ``name`` of frozen ``obj`` as its ``choice`` member (a plain string is accepted);
    ValueError ``message`` (formatted with the value) when it is none of the choices."""
    value = getattr(obj, name)
    if not isinstance(value, str) or value not in choice.values():
        raise ValueError(message.format(value=value))
    object.__setattr__(obj, name, choice(value))


def _check_spec(name: str, spec: Any) -> None:
    if spec is not None and not isinstance(spec, QuantSpec):
        raise ValueError(
            f"ZeroConfig.{name} must be a zeropp.comm.spec.QuantSpec or None, got {type(spec).__name__} "
            f"{spec!r}; build one with QuantSpec(bits=..., ...) or use ZeroConfig.from_recipe(name)"
        )


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """What to shard, what to quantize, and the knobs the sweeps turn."""

    stage: int = 3
    """ZeRO stage: 0 plain data parallel (all-reduce), 1 optimizer states sharded, 2 + gradients
    (reduce-scattered per block as soon as its backward is done), 3 + parameters (gathered per
    block just before its forward and backward, freed right after)."""

    precision: Precision = Precision.fp32
    """Compute and communication dtype (a :class:`~.choices.Precision`; a plain string is stored as
    its member): ``fp32`` (exactness checks), ``bf16``, or ``fp16`` (with dynamic loss scaling).
    Master weights and Adam states are always fp32."""

    weights: QuantSpec | None = None
    """qwZ: how the stage-3 parameter all-gathers (forward and backward) are quantized; None = full
    precision. One-hop gather, so ``intra_bits`` and ``error_feedback`` must stay unset."""

    hpz: bool = False
    """hpZ: keep a secondary copy of each gathered block partitioned inside the node after the
    forward gather, so backward gathers never leave the node (stage 3 only)."""

    hpz_size: int | None = None
    """Ranks in a hpZ group; must divide ranks per node. None = the whole node."""

    grads: QuantSpec | None = None
    """qgZ: how the gradient reduce-scatters (stages 1-3) are quantized: ``bits`` for the cross-node
    hop, ``intra_bits`` for the intra-node hop, ``error_feedback`` keeps each rank's residual;
    None = full precision."""

    weight_diff: QuantSpec | None = None
    """qWD (SDP4Bit's weight-difference quantization): after each optimizer step, send the quantized
    difference between the new weights and the weights every rank already holds, instead of the
    weights. Stages 1-2: the parameter all-gather. Stage 3 (needs ``hpz=True``): hpZ's secondary
    copies persist across steps and are refreshed by one global all-gather of these differences,
    so forward and backward gathers stay inside the node. The difference is taken against the
    weights the ranks hold (not the exact ones), so the rounding error does not accumulate over
    steps. One-hop gather: ``intra_bits`` and ``error_feedback`` must stay unset. None = off
    (``zeropp.runtime.weight_diff``)."""

    reduce_bucket_size: int = 500_000_000
    """Most elements (of the unsharded buffer) one gradient collective moves; a block larger than
    this is reduced in several column chunks. Blocks are never merged."""

    allgather_bucket_size: int = 500_000_000
    """Most elements (of the unsharded buffer) one parameter all-gather moves."""

    prefetch_depth: int = 1
    """Stage 3: how many upcoming blocks' gathers are issued while the current block computes
    (0 = gather synchronously when needed)."""

    persistence_threshold: int = 0
    """Stage 3: parameters with fewer elements stay replicated (never gathered) and their
    gradients are all-reduced. 0 = shard everything."""

    coalesce_numel: int = 0
    """Consecutive blocks whose parameters add up to at most this many elements share one unit
    (``block<i>-<j>``): one all-gather (forward and backward, stage 3) and one gradient
    reduce-scatter (stages 1-3; all-reduce at stage 0) instead of one per block, as DeepSpeed's
    ``stage3_prefetch_bucket_size`` / ``reduce_bucket_size`` bucket them. Fewer, larger collectives
    cost less per-collective overhead; the gathered buffer grows to at most this many elements
    (or one block when a block alone is larger). 0 = one unit per block. Checkpoints hold one
    layout per unit: they load with the same value (``blocks.coalesce_spans``)."""

    keep_at_turn: bool = False
    """Stage 3: the units backward needs first, the root (embeddings, final norm, head) and the
    last block's unit, stay gathered from the end of a training forward into backward instead of
    being freed and gathered again at once (as FSDP2 keeps its root and torchtitan its last
    block). Saves those two gathers per micro-step at no extra peak memory: both are live at the
    end of forward anyway, when the saved activations peak. False keeps the paper's schedule
    (every parameter gathered twice per micro-step: ZeRO-3's 3M), which the byte accounting and
    the scaling model then follow (``plan.py``)."""

    transport: Transport = DEFAULT_TRANSPORT
    """How the ZeRO group's plain (unquantized) gathers, reduce-scatters and all-reduces move data
    (a :class:`~.choices.Transport`): ``backend`` (the process group's: gloo, NCCL), ``shm`` (a
    region of shared memory that the CPU ranks of one host map: each rank writes its part once and
    reads what it needs, synchronised by a futex per rank; no copies through loopback TCP;
    ``zeropp.comm.shm``) or ``auto`` (the default: ``shm`` when every rank of the ZeRO group is a
    CPU rank of one node, the group has two or more ranks and ``/dev/shm`` has room for the region,
    else ``backend``; resolved once when the engine is built, the same on every rank, and recorded
    with its reason in ``ZeroEngine.transport``). An explicit ``shm`` is refused where it cannot
    work (GPU ranks, several nodes, no room). Either way the bytes are accounted as with the
    backend; the reductions through ``shm`` add in rank order (a reduce-scatter gives the backend
    path's bits; an all-reduce may differ from gloo's ring in the last bit, and in fp16 it sums in
    fp32 where gloo's sum can overflow: pin ``backend`` to keep gloo's exact all-reduce).
    Quantized collectives keep the backend."""

    grad_accum_steps: int = 1
    """Micro-batches per optimizer step; ``train_step`` must receive exactly this many."""

    grad_clip: float | None = None
    """Clip the global gradient norm (computed across all shards) to this value; None = off."""

    loss_scale_init: float = 2.0**16
    """fp16 only: initial dynamic loss scale."""

    loss_scale_window: int = 1000
    """fp16 only: good steps before the loss scale doubles (it halves on every overflow)."""

    offload_optimizer: OffloadTier = OffloadTier.none
    """ZeRO-Offload / ZeRO-Infinity (a :class:`~.choices.OffloadTier`): where the fp32 master shards and the Adam moments live and
    where the optimizer step runs: ``none`` (the model's device), ``cpu`` (pinned host memory, the
    step on the CPU, gradient shards copied down as their reductions finish, updated shards copied
    back), ``nvme`` (files under ``nvme_path``, streamed through the bounded host buffers below).
    Stages 1-3 (stage 0 has no optimizer shard to move)."""

    offload_param: OffloadTier = OffloadTier.none
    """Stage 3 (a :class:`~.choices.OffloadTier`): where each rank's parameter shards live between gathers: ``none`` (the model's
    device), ``cpu`` (pinned host memory, copied to the device ahead of each gather, honouring
    ``prefetch_depth``), ``nvme`` (files under ``nvme_path``)."""

    nvme_path: str | None = None
    """Directory for the ``nvme`` tier's swap files: must exist and be writable. Required when
    ``offload_optimizer`` or ``offload_param`` is ``nvme``, refused otherwise."""

    swap_buffers: int = 4
    """``nvme`` only: host staging buffers the swapper reads ahead into and writes behind from
    (host memory for swapping stays ``swap_buffers * swap_buffer_size`` fp32 elements, whatever
    the model size); at least 2, so one can be in flight while another is in use."""

    swap_buffer_size: int = 1 << 22
    """``nvme`` only: fp32 elements per staging buffer (a swapped tensor larger than this is moved
    in several pieces)."""

    offload_activations: bool = False
    """ZeRO-R: keep the tensors autograd saves for backward in (pinned) host memory and bring them
    back when backward needs them. With activation checkpointing only the blocks' inputs are saved,
    so this moves exactly the checkpointed activations."""

    quantize_frozen: QuantizeFrozen = QuantizeFrozen.none
    """MixZ++ (stage 3 only; a :class:`~.choices.QuantizeFrozen`): how the shards of frozen parameters (``requires_grad=False``, e.g. a
    LoRA base model) are stored and all-gathered: ``none`` (the compute dtype, all-gathered like the
    trainable ones, qwZ/hpZ applying), ``int8`` or ``int4`` (quantized ONCE at construction into
    the int codec's wire format, codes and scales in one byte buffer, all-gathered in that form and
    dequantized into the gather buffer; never re-quantized, so qwZ's spec does not apply; with
    ``hpz`` the node's share of the gathered rows is kept, still quantized, for every later gather).
    Stages 0-2 keep frozen parameters replicated in the compute dtype, so it must stay ``none``."""

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeroConfig.stage must be 0, 1, 2 or 3, got {self.stage!r}")
        _choice(
            self,
            "quantize_frozen",
            QuantizeFrozen,
            "ZeroConfig.quantize_frozen={value!r}; use one of " + str(QUANTIZE_FROZEN),
        )
        if self.quantize_frozen != "none" and self.stage != 3:
            raise ValueError(
                f"ZeroConfig.quantize_frozen={self.quantize_frozen!r} stores the stage-3 shards of frozen parameters "
                f"quantized; stage {self.stage} keeps frozen parameters whole on every rank (nothing is gathered), so "
                f"set stage=3 or quantize_frozen='none'"
            )
        _choice(
            self,
            "precision",
            Precision,
            "ZeroConfig.precision must be one of " + str(sorted(Precision.values())) + ", got {value!r}",
        )
        _check_spec("weights", self.weights)
        _check_spec("grads", self.grads)
        w, g = self.weights, self.grads
        if w is not None and self.stage != 3:
            raise ValueError(
                f"ZeroConfig.weights ({w.label}, qwZ) quantizes the stage-3 parameter gathers; set stage=3 or "
                f"weights=None (stage {self.stage} keeps full replicas, which quantized gathers would corrupt)"
            )
        if w is not None and (w.intra_bits is not None or w.error_feedback):
            raise ValueError(
                f"ZeroConfig.weights={w!r} sets intra_bits={w.intra_bits!r} / error_feedback={w.error_feedback!r}, "
                f"which only a two-hop gradient reduce-scatter uses; a weight gather has one hop and keeps no "
                f"residual, so leave both unset (intra_bits=None, error_feedback=False)"
            )
        self._check_weight_diff()
        _choice(
            self,
            "transport",
            Transport,
            "ZeroConfig.transport must be one of " + str(Transport.values()) + ", got {value!r}",
        )
        if self.hpz and self.stage != 3:
            raise ValueError(f"hpZ partitions stage-3 parameters; set stage=3 or hpz=False (got stage={self.stage})")
        if self.hpz_size is not None and not self.hpz:
            raise ValueError(f"hpz_size={self.hpz_size} is set but hpz=False; set hpz=True or hpz_size=None")
        if self.hpz_size is not None and self.hpz_size < 1:
            raise ValueError(f"ZeroConfig.hpz_size must be >= 1, got {self.hpz_size}")
        if g is not None and self.stage == 0:
            raise ValueError(
                f"ZeroConfig.grads ({g.label}, qgZ) quantizes the gradient reduce-scatter, which stage 0 does not use "
                f"(it all-reduces); set stage>=1 or grads=None"
            )
        for name in ("reduce_bucket_size", "allgather_bucket_size", "grad_accum_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"ZeroConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("prefetch_depth", "persistence_threshold", "coalesce_numel"):
            if getattr(self, name) < 0:
                raise ValueError(f"ZeroConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.keep_at_turn and self.stage != 3:
            raise ValueError(
                f"keep_at_turn keeps stage-3 units gathered between forward and backward; stage {self.stage} "
                f"has no forward or backward gathers, so set keep_at_turn=False (or stage=3)"
            )
        if self.persistence_threshold and self.stage != 3:
            raise ValueError(
                f"persistence_threshold only applies at stage 3 (params below it are not gathered); "
                f"set it to 0 for stage {self.stage}"
            )
        if self.grad_clip is not None and not (math.isfinite(self.grad_clip) and self.grad_clip > 0):
            raise ValueError(
                f"ZeroConfig.grad_clip must be a finite number > 0, or None for no clipping, got {self.grad_clip}"
            )
        if not (math.isfinite(self.loss_scale_init) and self.loss_scale_init > 0):
            raise ValueError(
                f"ZeroConfig.loss_scale_init must be a finite number > 0 (an infinite scale overflows "
                f"every step), got {self.loss_scale_init}"
            )
        if self.loss_scale_window < 1:
            raise ValueError(f"ZeroConfig.loss_scale_window must be >= 1, got {self.loss_scale_window}")
        self._check_offload()

    def _check_weight_diff(self) -> None:
        wd = self.weight_diff
        _check_spec("weight_diff", wd)
        if wd is None:
            return
        if self.stage == 0:
            raise ValueError(
                f"ZeroConfig.weight_diff ({wd.label}, qWD) replaces the parameter all-gather of stages 1-2 and hpZ's refresh "
                f"at stage 3; stage 0 updates full replicas locally and sends no weights. Set stage>=1 or "
                f"weight_diff=None"
            )
        if self.stage == 3 and not self.hpz:
            raise ValueError(
                f"ZeroConfig.weight_diff ({wd.label}) at stage 3 refreshes hpZ's secondary copies, which hpz=False does not "
                f"keep; set hpz=True or weight_diff=None"
            )
        if wd.intra_bits is not None or wd.error_feedback:
            raise ValueError(
                f"ZeroConfig.weight_diff={wd!r} sets intra_bits={wd.intra_bits!r} / error_feedback="
                f"{wd.error_feedback!r}: a weight-difference gather has one hop, and the weights the ranks hold "
                f"already carry the rounding error into the next difference (feeding it back again would "
                f"double it); leave both unset (intra_bits=None, error_feedback=False)"
            )

    def _check_offload(self) -> None:
        for name in ("offload_optimizer", "offload_param"):
            _choice(self, name, OffloadTier, f"ZeroConfig.{name} must be one of {OFFLOAD_TIERS}, got {{value!r}}")
        if self.offload_optimizer != "none" and self.stage == 0:
            raise ValueError(
                f"ZeroConfig.offload_optimizer={self.offload_optimizer!r} needs stage >= 1: stage 0 keeps a full "
                f"optimizer replica on every rank and has no shard to offload; set stage=1, 2 or 3"
            )
        if self.offload_param != "none" and self.stage != 3:
            raise ValueError(
                f"ZeroConfig.offload_param={self.offload_param!r} offloads stage-3 parameter shards; set stage=3 "
                f"(stage {self.stage} keeps full parameters on the device) or offload_param='none'"
            )
        uses_nvme = "nvme" in (self.offload_optimizer, self.offload_param)
        if uses_nvme and self.nvme_path is None:
            raise ValueError(
                "ZeroConfig: the 'nvme' offload tier needs nvme_path=<a writable directory on the disk to swap to>"
            )
        if self.nvme_path is not None:
            if not uses_nvme:
                raise ValueError(
                    f"ZeroConfig.nvme_path={self.nvme_path!r} is set but neither offload_optimizer nor "
                    f"offload_param is 'nvme'; set one of them to 'nvme' or nvme_path=None"
                )
            if not os.path.isdir(self.nvme_path):
                raise ValueError(
                    f"ZeroConfig.nvme_path={self.nvme_path!r} is not an existing directory; create it "
                    f"or point nvme_path at one"
                )
            if not os.access(self.nvme_path, os.W_OK | os.X_OK):
                raise ValueError(
                    f"ZeroConfig.nvme_path={self.nvme_path!r} is not writable by this process; "
                    f"choose a directory you can write to"
                )
        if self.swap_buffers < 2:
            raise ValueError(
                f"ZeroConfig.swap_buffers must be >= 2 (one in flight, one in use), got {self.swap_buffers}"
            )
        if self.swap_buffer_size < 1:
            raise ValueError(f"ZeroConfig.swap_buffer_size must be >= 1 element, got {self.swap_buffer_size}")

    @property
    def dtype(self) -> torch.dtype:
        """The compute/communication dtype."""
        return _DTYPES[self.precision]

    @property
    def shares_fp32_master(self) -> bool:
        """True when the fp32 master weights are the parameters themselves (no second fp32 copy,
        4 bytes per parameter fewer): an fp32 run, except stages 1-2 with ``weight_diff``, whose
        replicas hold the approximate weights the differences build (``weight_diff.py``). The
        engine aliases them only without offload; ``memory.expected_by_tier(shared_master=...)``
        takes this value and applies the offload rules itself."""
        return self.precision == "fp32" and not (self.weight_diff is not None and self.stage in (1, 2))

    @classmethod
    def from_recipe(cls, recipe: str | QuantRecipe, **fields: Any) -> ZeroConfig:
        """A config whose ``weights``, ``grads``, ``weight_diff`` and ``hpz`` come from a named recipe
        (``zeropp.comm.spec.RECIPES``: ``int8``, ``w8g4``, ``zeropp``, ``sdp4bit``, ...) or a
        :class:`QuantRecipe`; ``fields`` set the rest (and must not repeat the recipe's four)."""
        r = QuantRecipe.from_name(recipe) if isinstance(recipe, str) else recipe
        if not isinstance(r, QuantRecipe):
            raise ValueError(f"ZeroConfig.from_recipe needs a recipe name or a QuantRecipe, got {type(r).__name__}")
        clash = sorted(set(fields) & {"weights", "grads", "weight_diff", "hpz"})
        if clash:
            raise ValueError(
                f"ZeroConfig.from_recipe: {clash} come from the recipe; pass a different recipe "
                f"or build ZeroConfig(...) directly"
            )
        return cls(weights=r.weights, grads=r.grads, weight_diff=r.weight_diff, hpz=r.hpz, **fields)


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW hyper-parameters and the learning-rate schedule; the update is the same arithmetic as
    ``torch.optim.AdamW`` driven by ``LambdaLR(opt, lambda k: cfg.lr_factor(k))``."""

    lr: float = 1e-3
    """Peak learning rate (reached at the end of the warmup)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam moment decay rates."""
    eps: float = 1e-8
    """Added to the root of the second moment."""
    weight_decay: float = 0.01
    """Decoupled weight decay, applied to every parameter (as ``AdamW(model.parameters())``)."""
    warmup_steps: int = 0
    """Linear warmup: the optimizer step taken after ``k < warmup_steps`` steps uses
    ``lr * (k + 1) / warmup_steps`` (so the first step uses ``lr / warmup_steps`` and step
    ``warmup_steps - 1`` the full ``lr``). 0 = no warmup."""
    schedule: Schedule = Schedule.constant
    """After the warmup: ``constant`` (stay at ``lr``) or ``cosine`` (half a cosine from ``lr`` down
    to ``lr * min_lr_ratio`` at ``decay_steps``, then stay there)."""
    decay_steps: int | None = None
    """``cosine`` only (required there): optimizer steps from 0 to the end of the cosine, warmup
    included; from this step on the rate stays at the floor ``lr * min_lr_ratio``."""
    min_lr_ratio: float = 0.1
    """``cosine`` only: the floor of the rate as a fraction of ``lr``, in [0, 1]."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr) and self.lr >= 0):
            raise ValueError(f"OptimizerConfig.lr must be a finite number >= 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"OptimizerConfig.betas must be two values in [0, 1), got {self.betas}")
        if not (math.isfinite(self.eps) and self.eps > 0):
            raise ValueError(f"OptimizerConfig.eps must be a finite number > 0, got {self.eps}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"OptimizerConfig.weight_decay must be a finite number >= 0, got {self.weight_decay}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"OptimizerConfig.warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        _choice(self, "schedule", Schedule, "OptimizerConfig.schedule={value!r}; use one of " + str(SCHEDULES))
        if self.decay_steps is not None and (not isinstance(self.decay_steps, int) or self.decay_steps < 0):
            raise ValueError(f"OptimizerConfig.decay_steps must be an int >= 0 or None, got {self.decay_steps!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"OptimizerConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.schedule == "cosine":
            if self.decay_steps is None:
                raise ValueError(
                    "OptimizerConfig.schedule='cosine' needs decay_steps (the step where the cosine "
                    "reaches lr * min_lr_ratio); set decay_steps or use schedule='constant'"
                )
            if self.warmup_steps > self.decay_steps:
                raise ValueError(
                    f"OptimizerConfig.warmup_steps={self.warmup_steps} exceeds decay_steps="
                    f"{self.decay_steps}; the cosine starts after the warmup, so choose "
                    f"decay_steps >= warmup_steps"
                )
        elif self.decay_steps is not None:
            raise ValueError(
                f"OptimizerConfig.decay_steps={self.decay_steps} does nothing with schedule="
                f"'constant'; set schedule='cosine' or decay_steps=None"
            )

    def lr_factor(self, step: int) -> float:
        """The multiplier of ``lr`` for the update made after ``step`` optimizer steps (the
        ``lr_lambda`` of an equivalent ``torch.optim.lr_scheduler.LambdaLR``)."""
        if step < 0:
            raise ValueError(f"lr_factor: step must be >= 0, got {step}")
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return 1.0
        assert self.decay_steps is not None
        span = self.decay_steps - self.warmup_steps
        if step >= self.decay_steps or span == 0:
            return self.min_lr_ratio
        progress = (step - self.warmup_steps) / span  # in [0, 1)
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def lr_at(self, step: int) -> float:
        """Learning rate of the update made after ``step`` optimizer steps: ``lr * lr_factor(step)``
        (computed exactly as ``LambdaLR`` does, so the two agree bit for bit). ``step`` counts
        updates made: an fp16 step skipped on overflow does not advance the schedule."""
        return self.lr * self.lr_factor(step)


def validate_against_topology(cfg: ZeroConfig, world_size: int, nodes: int, ranks_per_node: int) -> None:
    """Checks that need the world shape; the engine runs them before allocating anything."""
    if nodes * ranks_per_node != world_size:
        raise ValueError(
            f"topology {nodes} nodes x {ranks_per_node} ranks = {nodes * ranks_per_node} does not match "
            f"the world size {world_size}; pass a Topology built for this world"
        )
    if cfg.transport == "shm" and nodes > 1:
        raise ValueError(
            f"transport='shm' moves the ZeRO group's data through the shared memory of one host, but the group spans "
            f"{nodes} nodes; use transport='backend' (or one node)"
        )
    if cfg.hpz:
        size = cfg.hpz_size or ranks_per_node
        if ranks_per_node % size:
            raise ValueError(
                f"hpz_size={size} does not divide ranks_per_node={ranks_per_node}; a hpZ group must sit "
                f"inside one node, so choose a divisor of {ranks_per_node}"
            )
