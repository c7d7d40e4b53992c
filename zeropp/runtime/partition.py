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
from functools import cached_property

import torch
from torch import nn


KINDS = ("replicated", "sharded_opt", "sharded")


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives inside its unit's flat buffer."""

    name: str
    """Parameter name in the unwrapped model (``model.named_parameters()``)."""
    shape: tuple[int, ...]
    """The parameter's shape."""
    offset: int
    """First element of the parameter in the flat buffer."""
    numel: int
    """Elements of the parameter."""


@dataclass(frozen=True, kw_only=True)
class UnitLayout:
    """The frozen description of one flat unit: which parameters, where, and how it is cut into
    shards. A value (no tensors), so checkpoints record it, memory and checkpoint code read it,
    and two engines can compare theirs. ``kind`` decides how the unit is reduced and gathered:

    - ``replicated``: full parameters always present, gradients all-reduced, optimizer state
      for the whole unit on every rank (stage 0; stage-3 parameters under the persistence threshold).
    - ``sharded_opt``: full parameters always present, gradients reduce-scattered, optimizer
      state for this rank's shard; updated shards all-gathered after the step (stages 1 and 2).
    - ``sharded``: only this rank's shard is kept; the full buffer exists between a gather and
      its release (stage 3).

    Sharding: the buffer is padded to ``padded = num_shards * shard_numel`` with
    ``shard_numel = ceil(numel / num_shards)``, and shard ``r`` is ``[r * S, (r + 1) * S)``. Without
    the padding, shard ``r`` is exactly ``torch.chunk``'s (and a ``Shard(0)`` DTensor's) piece ``r``
    of the unpadded ``[numel]`` buffer, which is what lets checkpoints reshard.
    """

    name: str
    """``block<i>``, ``root`` or ``persistent``."""
    kind: str
    """``replicated``, ``sharded_opt`` or ``sharded`` (see above)."""
    slots: tuple[Slot, ...]
    """The parameters, in buffer order."""
    num_shards: int
    """Shards the buffer is cut into: the world size, or 1 for a replicated unit."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"UnitLayout.kind={self.kind!r}; use one of {KINDS}")
        off = 0
        for s in self.slots:
            if s.offset != off:
                raise ValueError(f"UnitLayout {self.name}: {s.name} starts at {s.offset}, expected {off} (packed order)")
            off += s.numel

    @classmethod
    def pack(cls, name: str, params: list[tuple[str, tuple[int, ...]]], *, kind: str, num_shards: int) -> "UnitLayout":
        """Lay ``(name, shape)`` parameters out back to back."""
        slots, off = [], 0
        for n, shape in params:
            numel = 1
            for d in shape:
                numel *= d
            slots.append(Slot(n, tuple(shape), off, numel))
            off += numel
        return cls(name=name, kind=kind, slots=tuple(slots), num_shards=num_shards)

    @cached_property
    def numel(self) -> int:
        """Elements of all parameters (unpadded buffer)."""
        return sum(s.numel for s in self.slots)

    @property
    def shard_numel(self) -> int:
        """Elements of one shard, ``ceil(numel / num_shards)`` (at least 1)."""
        return max(1, -(-self.numel // self.num_shards))

    @property
    def padded(self) -> int:
        """Elements of the padded buffer, ``num_shards * shard_numel``."""
        return self.num_shards * self.shard_numel

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Padded-buffer range of shard ``rank``."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def unpadded_range(self, rank: int) -> tuple[int, int]:
        """Range of shard ``rank`` inside the unpadded ``[numel]`` buffer (empty past the end)."""
        a, b = self.shard_range(rank)
        return min(a, self.numel), min(b, self.numel)

    def params(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(name, shape)`` per parameter: what must match for a checkpoint to load."""
        return [(s.name, s.shape) for s in self.slots]

    def to_dict(self) -> dict:
        """JSON-ready description (checkpoint metadata)."""
        return {"name": self.name, "kind": self.kind, "num_shards": self.num_shards,
                "params": [[s.name, list(s.shape)] for s in self.slots]}

    @classmethod
    def from_dict(cls, d: dict) -> "UnitLayout":
        return cls.pack(d["name"], [(n, tuple(sh)) for n, sh in d["params"]], kind=d["kind"], num_shards=d["num_shards"])


@dataclass(eq=False)
class FlatUnit:
    """One communication unit at runtime: its :class:`UnitLayout`, the ``Parameter`` objects it
    binds, and the buffers and per-step flags the engine and the stage-3 hooks keep for it."""

    layout: UnitLayout
    params: list[nn.Parameter]
    shard_rank: int
    dtype: torch.dtype
    device: torch.device = torch.device("cpu")
    # runtime state, owned by the engine
    flat: torch.Tensor | None = None  # [padded] compute dtype, full parameters (when present)
    param_shard: torch.Tensor | None = None  # [S] compute dtype (stage 3)
    grad_shard: torch.Tensor | None = None  # [S] compute dtype, accumulated reduced gradient
    secondary: torch.Tensor | None = None  # [padded / hpz] compute dtype (hpZ)
    state: str = "free"  # free | inflight | ready  (stage 3 gather state)
    work: object | None = None  # pending gather handle
    grads_ready: int = 0  # parameters whose gradient was accumulated in this backward
    reduced: bool = False  # gradients of this micro-step already sent
    extra: dict = field(default_factory=dict)

    @classmethod
    def build(cls, name: str, named: list[tuple[str, nn.Parameter]], *, kind: str, num_shards: int,
              shard_rank: int, dtype: torch.dtype) -> "FlatUnit":
        devices = {p.device for _, p in named}
        if len(devices) > 1:
            raise ValueError(f"unit {name!r} has parameters on several devices {devices}; move the model to one device")
        layout = UnitLayout.pack(name, [(n, tuple(p.shape)) for n, p in named], kind=kind, num_shards=num_shards)
        return cls(layout=layout, params=[p for _, p in named], shard_rank=shard_rank, dtype=dtype, device=devices.pop())

    # the layout's facts, for brevity at the call sites
    @property
    def name(self) -> str:
        return self.layout.name

    @property
    def kind(self) -> str:
        return self.layout.kind

    @property
    def slots(self) -> tuple[Slot, ...]:
        return self.layout.slots

    @property
    def num_shards(self) -> int:
        return self.layout.num_shards

    @property
    def numel(self) -> int:
        return self.layout.numel

    @property
    def padded(self) -> int:
        return self.layout.padded

    @property
    def shard_numel(self) -> int:
        return self.layout.shard_numel

    def shard_range(self) -> tuple[int, int]:
        return self.layout.shard_range(self.shard_rank)

    def param_name(self, p: torch.Tensor) -> str:
        """Name of parameter ``p`` of this unit (for messages)."""
        return next((s.name for s, q in zip(self.slots, self.params) if q is p), "a parameter")

    def flatten_data(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Current parameter values as a new padded flat tensor ``[padded]``."""
        out = torch.zeros(self.padded, dtype=dtype or self.dtype, device=self.device)
        for s, p in zip(self.slots, self.params):
            out[s.offset : s.offset + s.numel].copy_(p.data.reshape(-1))
        return out

    def flatten_grads(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """Gradients as a padded flat tensor ``[padded]`` (missing gradients count as zero); clears
        ``p.grad``. Written into ``out`` (``[padded]``, e.g. a pool buffer) when given, else a new tensor."""
        if out is None:
            out = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        else:
            if out.shape != (self.padded,) or out.dtype != self.dtype:
                raise ValueError(f"flatten_grads(out=...) of {self.name} needs [{self.padded}] {self.dtype}, got "
                                 f"{list(out.shape)} {out.dtype}")
            out.zero_()
        for s, p in zip(self.slots, self.params):
            g = p.grad
            if g is not None:
                out[s.offset : s.offset + s.numel].copy_(g.reshape(-1))
                p.grad = None
        return out

    def bind(self, flat: torch.Tensor) -> None:
        """Point every parameter at its view of ``flat`` (``[padded]``)."""
        self.flat = flat
        for s, p in zip(self.slots, self.params):
            p.data = flat[s.offset : s.offset + s.numel].view(s.shape)

    def release(self) -> None:
        """Drop the full buffer; parameters become empty tensors until the next ``bind``."""
        self.flat = None
        self.state = "free"
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        for p in self.params:
            p.data = empty

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Split a full flat buffer into ``{param name: tensor of the param's shape}`` (views)."""
        return unflatten(self.layout, flat)


def unflatten(layout: UnitLayout, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Split a flat buffer (``[numel]`` or longer) of ``layout`` into its parameters (views)."""
    return {s.name: flat[s.offset : s.offset + s.numel].view(s.shape) for s in layout.slots}


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
