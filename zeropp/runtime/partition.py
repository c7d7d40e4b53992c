"""Flat parameter units: how parameters are grouped, padded and sharded.

A *unit* is a set of parameters that is communicated as one flat buffer: one per transformer
block, one "root" unit for everything outside the blocks, and (at stage 3) one replicated unit
for parameters under the persistence threshold. The flat buffer is padded to a multiple of the
number of shards so that every rank owns an equal, contiguous slice ``[r*S, (r+1)*S)``; equal
slices are what all-gather / reduce-scatter need, and contiguity means a shard is a plain view.

Parameters are never copied into the module by value: ``bind`` points each ``p.data`` at a
view of the flat buffer and ``release`` points it at an empty tensor, so the module code runs
unchanged and autograd still sees the same ``Parameter`` objects (whose saved references are
re-populated before backward by re-binding).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Slot:
    """Where one parameter lives inside its unit's flat buffer."""

    name: str
    param: nn.Parameter
    shape: torch.Size
    offset: int
    numel: int


@dataclass
class FlatUnit:
    """One communication unit. ``kind`` decides how it is reduced and whether it is gathered:

    - ``replicated``: full parameters always present, gradients all-reduced, optimizer state
      for the whole unit on every rank (stage 0; stage-3 parameters under the persistence threshold).
    - ``sharded_opt``: full parameters always present, gradients reduce-scattered, optimizer
      state for this rank's shard; updated shards all-gathered after the step (stages 1 and 2).
    - ``sharded``: only this rank's shard is kept; the full buffer exists between a gather and
      its release (stage 3).
    """

    name: str
    slots: list[Slot]
    kind: str
    num_shards: int
    shard_rank: int
    dtype: torch.dtype
    device: torch.device = torch.device("cpu")
    numel: int = 0
    padded: int = 0
    shard_numel: int = 0
    # runtime state, owned by the engine
    flat: torch.Tensor | None = None  # [padded] compute dtype, full parameters (when present)
    param_shard: torch.Tensor | None = None  # [S] compute dtype (stage 3)
    grad_shard: torch.Tensor | None = None  # [S] compute dtype, accumulated reduced gradient
    secondary: torch.Tensor | None = None  # [padded / hpz] compute dtype (hpZ)
    error_feedback: object | None = None  # qgZ error-feedback state (opaque to this module)
    state: str = "free"  # free | inflight | ready  (stage 3 gather state)
    work: object | None = None  # pending gather handle
    grads_ready: int = 0  # parameters whose gradient was accumulated in this backward
    reduced: bool = False  # gradients of this micro-step already sent
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        off = 0
        for s in self.slots:
            s.offset = off
            off += s.numel
        self.numel = off
        n = self.num_shards
        self.padded = max(n, -(-off // n) * n)
        self.shard_numel = self.padded // n

    @classmethod
    def build(cls, name: str, named: list[tuple[str, nn.Parameter]], *, kind: str, num_shards: int,
              shard_rank: int, dtype: torch.dtype) -> "FlatUnit":
        slots = [Slot(n, p, p.shape, 0, p.numel()) for n, p in named]
        devices = {p.device for _, p in named}
        if len(devices) > 1:
            raise ValueError(f"unit {name!r} has parameters on several devices {devices}; move the model to one device")
        return cls(name=name, slots=slots, kind=kind, num_shards=num_shards, shard_rank=shard_rank, dtype=dtype,
                   device=devices.pop())

    @property
    def params(self) -> list[nn.Parameter]:
        return [s.param for s in self.slots]

    def shard_range(self) -> tuple[int, int]:
        start = self.shard_rank * self.shard_numel
        return start, start + self.shard_numel

    def flatten_data(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Current parameter values as a new padded flat tensor ``[padded]``."""
        out = torch.zeros(self.padded, dtype=dtype or self.dtype, device=self.device)
        for s in self.slots:
            out[s.offset : s.offset + s.numel].copy_(s.param.data.reshape(-1))
        return out

    def flatten_grads(self) -> torch.Tensor:
        """Gradients as a padded flat tensor ``[padded]`` (missing gradients count as zero); clears ``p.grad``."""
        out = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        for s in self.slots:
            g = s.param.grad
            if g is not None:
                out[s.offset : s.offset + s.numel].copy_(g.reshape(-1))
                s.param.grad = None
        return out

    def bind(self, flat: torch.Tensor) -> None:
        """Point every parameter at its view of ``flat`` (``[padded]``)."""
        self.flat = flat
        for s in self.slots:
            s.param.data = flat[s.offset : s.offset + s.numel].view(s.shape)

    def release(self) -> None:
        """Drop the full buffer; parameters become empty tensors until the next ``bind``."""
        self.flat = None
        self.state = "free"
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        for s in self.slots:
            s.param.data = empty

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Split a full flat buffer into ``{param name: tensor of the param's shape}`` (views)."""
        return {s.name: flat[s.offset : s.offset + s.numel].view(s.shape) for s in self.slots}

    def layout(self) -> list[tuple[str, tuple[int, ...]]]:
        """What a checkpoint records to check it is loaded into the same partitioning."""
        return [(s.name, tuple(s.shape)) for s in self.slots]


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The per-block units: ``model.blocks`` if it is a ``ModuleList``, else the longest ModuleList."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList):
        return list(blocks)
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def build_units(model: nn.Module, *, stage: int, world_size: int, rank: int, dtype: torch.dtype,
                persistence_threshold: int = 0
                ) -> tuple[list[FlatUnit], list[tuple[nn.Module, FlatUnit]], FlatUnit | None, FlatUnit | None]:
    """Partition ``model``'s parameters into units.

    Returns ``(all_units, blocks, root_unit, persistent_unit)``; ``blocks`` pairs each block
    module (that has parameters to shard) with its unit, in forward order. Shared parameters (one tensor under two names) are rejected: they would be
    reduced twice.
    """
    kind = {0: "replicated", 1: "sharded_opt", 2: "sharded_opt", 3: "sharded"}[stage]
    shards = 1 if kind == "replicated" else world_size
    srank = 0 if kind == "replicated" else rank
    seen: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            raise ValueError(f"parameters {seen[id(p)]!r} and {name!r} are the same tensor; untie them before wrapping")
        seen[id(p)] = name
    names = {id(p): n for n, p in model.named_parameters()}
    persistent: list[tuple[str, nn.Parameter]] = []

    def keep(p: nn.Parameter) -> bool:
        if not p.requires_grad:
            return False
        if stage == 3 and p.numel() < persistence_threshold:
            persistent.append((names[id(p)], p))
            return False
        return True

    blocks: list[tuple[nn.Module, FlatUnit]] = []
    in_block: set[int] = set()
    for i, blk in enumerate(find_blocks(model)):
        named = [(names[id(p)], p) for p in blk.parameters()]
        in_block.update(id(p) for _, p in named)
        named = [(n, p) for n, p in named if keep(p)]
        if named:
            blocks.append((blk, FlatUnit.build(f"block{i}", named, kind=kind, num_shards=shards, shard_rank=srank, dtype=dtype)))
    root_named = [(n, p) for n, p in model.named_parameters() if id(p) not in in_block and keep(p)]
    root = FlatUnit.build("root", root_named, kind=kind, num_shards=shards, shard_rank=srank, dtype=dtype) if root_named else None
    pers = FlatUnit.build("persistent", persistent, kind="replicated", num_shards=1, shard_rank=0, dtype=dtype) if persistent else None
    units = ([root] if root else []) + [u for _, u in blocks] + ([pers] if pers else [])
    return units, blocks, root, pers
