"""Configuration of the ZeRO runtime.

Both dataclasses are frozen and keyword-only so a config is a value: it can be logged, hashed,
compared across a sweep and never mutated halfway through training. Every check that can be made
without a process group runs in ``__post_init__``, so a bad setting fails before any process
group, buffer or collective exists; checks that need the world (hpZ size vs ranks per node,
divisibility of the world) run in :func:`validate_against_topology`, which the engine calls
before it allocates anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from zeropp.kernels import SUPPORTED_BITS  # bit widths the quantization kernels implement

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _check_bits(name: str, bits: Any) -> None:
    if bits is not None and bits not in SUPPORTED_BITS:
        raise ValueError(
            f"ZeroConfig.{name}={bits!r} is not supported by the quantization kernels; "
            f"use one of {SUPPORTED_BITS} or None to switch it off"
        )


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """What to shard, what to quantize, and the knobs the sweeps turn."""

    stage: int = 3
    """ZeRO stage: 0 plain data parallel (all-reduce), 1 optimizer states sharded, 2 + gradients
    (reduce-scattered per block as soon as its backward is done), 3 + parameters (gathered per
    block just before its forward and backward, freed right after)."""

    precision: str = "fp32"
    """Compute and communication dtype: ``fp32`` (exactness checks), ``bf16``, or ``fp16`` (with
    dynamic loss scaling). Master weights and Adam states are always fp32."""

    qwz_bits: int | None = None
    """qwZ: bits of the quantized forward/backward parameter all-gather (stage 3 only); None = off."""

    qwz_group_size: int | None = None
    """Elements per quantization scale for qwZ; None = kernel default (512)."""

    qwz_stochastic: bool = False
    """Round the qwZ weight gathers stochastically (unbiased: the expected gathered weight is the
    weight) instead of to nearest; needs ``qwz_bits``. Noise differs per rank and per call
    (seed rule: ``zeropp.comm.quantized_all_gather``)."""

    hpz: bool = False
    """hpZ: keep a secondary copy of each gathered block partitioned inside the node after the
    forward gather, so backward gathers never leave the node (stage 3 only)."""

    hpz_size: int | None = None
    """Ranks in a hpZ group; must divide ranks per node. None = the whole node."""

    qgz_bits: int | None = None
    """qgZ: bits of the cross-node hop of the quantized hierarchical gradient reduce-scatter
    (stages 1-3); None = off."""

    qgz_intra_bits: int | None = None
    """Bits of the intra-node hop of qgZ; None = same as ``qgz_bits``."""

    qgz_group_size: int | None = None
    """Elements per quantization scale for qgZ; None = kernel default (128)."""

    qgz_error_feedback: bool = False
    """Keep the quantization error of each gradient reduce-scatter and add it to the next one."""

    qgz_stochastic: bool = False
    """Round every qgZ quantization (both hops) stochastically, so the reduced gradient is unbiased;
    needs ``qgz_bits``. Seed rule: ``zeropp.comm.quantized_reduce_scatter``."""

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

    grad_accum_steps: int = 1
    """Micro-batches per optimizer step; ``train_step`` must receive exactly this many."""

    grad_clip: float | None = None
    """Clip the global gradient norm (computed across all shards) to this value; None = off."""

    loss_scale_init: float = 2.0**16
    """fp16 only: initial dynamic loss scale."""

    loss_scale_window: int = 1000
    """fp16 only: good steps before the loss scale doubles (it halves on every overflow)."""

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeroConfig.stage must be 0, 1, 2 or 3, got {self.stage!r}")
        if self.precision not in _DTYPES:
            raise ValueError(f"ZeroConfig.precision must be one of {sorted(_DTYPES)}, got {self.precision!r}")
        _check_bits("qwz_bits", self.qwz_bits)
        _check_bits("qgz_bits", self.qgz_bits)
        _check_bits("qgz_intra_bits", self.qgz_intra_bits)
        for name, bits in (("qwz_group_size", (self.qwz_bits,)), ("qgz_group_size", (self.qgz_bits, self.qgz_intra_bits))):
            gs = getattr(self, name)
            if gs is not None and (not isinstance(gs, int) or gs < 1):
                raise ValueError(f"ZeroConfig.{name} must be a positive int or None, got {gs!r}")
            if gs is not None and gs % 2 and 4 in bits:
                raise ValueError(f"ZeroConfig.{name}={gs} is odd; INT4 packs two codes per byte, so use an even size")
        if self.qwz_bits is not None and self.stage != 3:
            raise ValueError(
                f"qwZ (qwz_bits={self.qwz_bits}) quantizes the stage-3 parameter gathers; set stage=3 "
                f"or qwz_bits=None (stage {self.stage} keeps full replicas, which quantized gathers would corrupt)"
            )
        if self.hpz and self.stage != 3:
            raise ValueError(f"hpZ partitions stage-3 parameters; set stage=3 or hpz=False (got stage={self.stage})")
        if self.hpz_size is not None and not self.hpz:
            raise ValueError(f"hpz_size={self.hpz_size} is set but hpz=False; set hpz=True or hpz_size=None")
        if self.hpz_size is not None and self.hpz_size < 1:
            raise ValueError(f"ZeroConfig.hpz_size must be >= 1, got {self.hpz_size}")
        if self.qgz_bits is not None and self.stage == 0:
            raise ValueError(
                "qgZ quantizes the gradient reduce-scatter, which stage 0 does not use (it all-reduces); "
                "set stage>=1 or qgz_bits=None"
            )
        if self.qgz_bits is None and (self.qgz_intra_bits is not None or self.qgz_error_feedback):
            raise ValueError("qgz_intra_bits / qgz_error_feedback need qgZ on; set qgz_bits too")
        for name, bits_name in (("qwz_stochastic", "qwz_bits"), ("qgz_stochastic", "qgz_bits")):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ZeroConfig.{name} must be True or False, got {getattr(self, name)!r}")
            if getattr(self, name) and getattr(self, bits_name) is None:
                raise ValueError(
                    f"ZeroConfig.{name}=True selects stochastic rounding, but {bits_name}=None quantizes "
                    f"nothing; set {bits_name} (8 or 4) or {name}=False"
                )
        for name in ("reduce_bucket_size", "allgather_bucket_size", "grad_accum_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"ZeroConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("prefetch_depth", "persistence_threshold"):
            if getattr(self, name) < 0:
                raise ValueError(f"ZeroConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.persistence_threshold and self.stage != 3:
            raise ValueError(
                f"persistence_threshold only applies at stage 3 (params below it are not gathered); "
                f"set it to 0 for stage {self.stage}"
            )
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"ZeroConfig.grad_clip must be > 0 or None, got {self.grad_clip}")
        if self.loss_scale_init <= 0 or self.loss_scale_window < 1:
            raise ValueError("ZeroConfig.loss_scale_init must be > 0 and loss_scale_window >= 1")

    @property
    def dtype(self) -> torch.dtype:
        """The compute/communication dtype."""
        return _DTYPES[self.precision]


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW hyper-parameters; the update is the same arithmetic as ``torch.optim.AdamW``."""

    lr: float = 1e-3
    """Learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam moment decay rates."""
    eps: float = 1e-8
    """Added to the root of the second moment."""
    weight_decay: float = 0.01
    """Decoupled weight decay, applied to every parameter (as ``AdamW(model.parameters())``)."""

    def __post_init__(self) -> None:
        if not self.lr >= 0:
            raise ValueError(f"OptimizerConfig.lr must be >= 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"OptimizerConfig.betas must be two values in [0, 1), got {self.betas}")
        if not self.eps > 0 or self.weight_decay < 0:
            raise ValueError("OptimizerConfig.eps must be > 0 and weight_decay >= 0")


def validate_against_topology(cfg: ZeroConfig, world_size: int, nodes: int, ranks_per_node: int) -> None:
    """Checks that need the world shape; the engine runs them before allocating anything."""
    if nodes * ranks_per_node != world_size:
        raise ValueError(
            f"topology {nodes} nodes x {ranks_per_node} ranks = {nodes * ranks_per_node} does not match "
            f"the world size {world_size}; pass a Topology built for this world"
        )
    if cfg.hpz:
        size = cfg.hpz_size or ranks_per_node
        if ranks_per_node % size:
            raise ValueError(
                f"hpz_size={size} does not divide ranks_per_node={ranks_per_node}; a hpZ group must sit "
                f"inside one node, so choose a divisor of {ranks_per_node}"
            )
