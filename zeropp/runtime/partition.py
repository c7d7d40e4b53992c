"""Flat parameter units: a set of parameters communicated as one padded, sharded flat buffer.

A *unit* is one per transformer block (or span of coalesced blocks), one "root" unit for everything
outside the blocks, and (at stage 3) one replicated unit for parameters under the persistence
threshold; which parameters go where is ``units.py``'s business, which modules are the blocks
``blocks.py``'s. The flat buffer is padded to a multiple of the number of shards so that every
rank owns an equal, contiguous slice ``[r*S, (r+1)*S)``; equal slices are what all-gather /
reduce-scatter need, and contiguity means a shard is a plain view.

Parameters are never copied into the module by value: ``bind`` points each ``p.data`` at a
view of the flat buffer and ``release`` points it at an empty tensor, so the module code runs
unchanged and autograd still sees the same ``Parameter`` objects (whose saved references are
re-populated before backward by re-binding).

Shared (tied) parameters: one ``Parameter`` registered under several names (GPT-2's token embedding
and output head) gets one slot, under its first name in ``named_parameters()`` with the other
names as :attr:`Slot.aliases`, so it has one shard, one gradient (autograd sums every use into
``p.grad`` once) and one optimizer state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Sequence, cast

import torch
from torch import nn

KINDS = ("replicated", "sharded_opt", "sharded", "frozen")


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
    aliases: tuple[str, ...] = ()
    """Other names of the same ``Parameter`` in the unwrapped model (tied weights), e.g.
    ``("head.weight",)`` for the GPT's ``tok_emb.weight``; they share this slot's values."""


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
    - ``frozen``: stage 3's frozen parameters (``requires_grad=False``) of one block or the root:
      sharded and gathered like ``sharded``, but no gradient, no optimizer state and no
      reduce-scatter; the shard may be stored quantized (``frozen.py``, MixZ++).

    Sharding: the buffer is padded to ``padded = num_shards * shard_numel`` with
    ``shard_numel = ceil(numel / num_shards)``, and shard ``r`` is ``[r * S, (r + 1) * S)``. Without
    the padding, shard ``r`` is exactly ``torch.chunk``'s (and a ``Shard(0)`` DTensor's) piece ``r``
    of the unpadded ``[numel]`` buffer, which is what lets checkpoints reshard.
    """

    name: str
    """``block<i>`` (``block<i>-<j>``: blocks i..j coalesced), ``root`` or ``persistent``
    (``block<i>.frozen``, ``root.frozen`` for frozen units)."""
    kind: str
    """``replicated``, ``sharded_opt``, ``sharded`` or ``frozen`` (see above)."""
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
                raise ValueError(
                    f"UnitLayout {self.name}: {s.name} starts at {s.offset}, expected {off} (packed order)"
                )
            off += s.numel

    @classmethod
    def pack(
        cls,
        name: str,
        params: list[tuple[str, tuple[int, ...]]],
        *,
        kind: str,
        num_shards: int,
        aliases: dict[str, Sequence[str]] | None = None,
    ) -> UnitLayout:
        """Lay ``(name, shape)`` parameters out back to back; ``aliases``: name -> its other names."""
        slots, off = [], 0
        aliases = aliases or {}
        for n, shape in params:
            numel = 1
            for d in shape:
                numel *= d
            slots.append(Slot(n, tuple(shape), off, numel, tuple(aliases.get(n, ()))))
            off += numel
        return cls(name=name, kind=kind, slots=tuple(slots), num_shards=num_shards)

    @cached_property
    def numel(self) -> int:
        """Elements of all parameters (unpadded buffer)."""
        return sum(s.numel for s in self.slots)

    @cached_property
    def views(self) -> tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...]:
        """``(shape, contiguous strides, offset)`` per parameter: its view of a flat buffer."""
        out = []
        for s in self.slots:
            strides, step = [], 1
            for d in reversed(s.shape):
                strides.append(step)
                step *= max(d, 1)
            out.append((s.shape, tuple(reversed(strides)), s.offset))
        return tuple(out)

    @cached_property
    def shard_numel(self) -> int:
        """Elements of one shard, ``ceil(numel / num_shards)`` (at least 1)."""
        return max(1, -(-self.numel // self.num_shards))

    @cached_property
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
        return {
            "name": self.name,
            "kind": self.kind,
            "num_shards": self.num_shards,
            "params": [[s.name, list(s.shape)] for s in self.slots],
            "aliases": {s.name: list(s.aliases) for s in self.slots if s.aliases},
        }

    @classmethod
    def from_dict(cls, d: dict) -> UnitLayout:
        return cls.pack(
            d["name"],
            [(n, tuple(sh)) for n, sh in d["params"]],
            kind=d["kind"],
            num_shards=d["num_shards"],
            aliases=d.get("aliases"),
        )


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
    param_shard: torch.Tensor | None = None  # [S] compute dtype (stage 3; frozen: None when stored quantized)
    grad_shard: torch.Tensor | None = None  # [S] compute dtype, accumulated reduced gradient
    secondary: torch.Tensor | None = None  # hpZ: [padded / hpz] compute dtype, or qwZ's uint8 wire rows [W / hpz * B]
    state: str = "free"  # free | inflight | ready  (stage 3 gather state)
    work: object | None = None  # pending gather handle
    grads_ready: int = 0  # parameters whose gradient was accumulated in this backward
    reduced: bool = False  # gradients of this micro-step already sent
    extra: dict = field(default_factory=dict)
    _empty: torch.Tensor | None = field(default=None, init=False, repr=False)  # what release() binds

    @classmethod
    def build(
        cls,
        name: str,
        named: list[tuple[str, nn.Parameter]],
        *,
        kind: str,
        num_shards: int,
        shard_rank: int,
        dtype: torch.dtype,
        aliases: dict[str, Sequence[str]] | None = None,
    ) -> FlatUnit:
        devices = {p.device for _, p in named}
        if len(devices) > 1:
            raise ValueError(f"unit {name!r} has parameters on several devices {devices}; move the model to one device")
        layout = UnitLayout.pack(
            name, [(n, tuple(p.shape)) for n, p in named], kind=kind, num_shards=num_shards, aliases=aliases
        )
        return cls(
            layout=layout, params=[p for _, p in named], shard_rank=shard_rank, dtype=dtype, device=devices.pop()
        )

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

    def flatten_grads(
        self, out: torch.Tensor | None = None, views: Sequence[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Gradients as a padded flat tensor ``[padded]`` (missing gradients count as zero); clears
        ``p.grad``. Written into ``out`` (``[padded]``, e.g. a pool buffer) when given, else a new tensor.
        Each element is written once: the slots are packed without gaps (``UnitLayout``), so only
        the slots without a gradient and the padding after the last slot are zeroed. When every
        parameter has a gradient of the unit's dtype, one ``torch.cat`` into ``out`` writes them all:
        one kernel instead of one copy per parameter (on a GPU each copy is a launch and, in a
        post-accumulate-grad hook, tens of microseconds of host time). ``views``: the parameters'
        views of ``out`` already made (``BufferPool.views``); then one ``torch._foreach_copy_``
        into them writes the same elements without flattening every gradient first."""
        if out is None:
            out = torch.empty(self.padded, dtype=self.dtype, device=self.device)
        elif out.shape != (self.padded,) or out.dtype != self.dtype:
            raise ValueError(
                f"flatten_grads(out=...) of {self.name} needs [{self.padded}] {self.dtype}, got "
                f"{list(out.shape)} {out.dtype}"
            )
        end = self.slots[-1].offset + self.slots[-1].numel if self.slots else 0
        grads = [p.grad for p in self.params]
        if grads and all(g is not None and g.dtype == self.dtype for g in grads):
            if views is not None:
                torch._foreach_copy_(list(views), cast(list[torch.Tensor], grads))  # the packed slots
            else:
                torch.cat([g.reshape(-1) for g in grads if g is not None], out=out[:end])  # [end]: the packed slots
            for p in self.params:
                p.grad = None
        else:
            for s, p in zip(self.slots, self.params):
                g, dst = p.grad, out[s.offset : s.offset + s.numel]
                if g is None:
                    dst.zero_()
                else:
                    dst.copy_(g.reshape(-1))
                    p.grad = None
        if end < self.padded:
            out[end:].zero_()
        return out

    def bind(self, flat: torch.Tensor, views: Sequence[torch.Tensor] | None = None) -> None:
        """Point every parameter at its view of ``flat`` (``[padded]``). One ``as_strided`` per
        parameter (its shape, contiguous strides, the slot's offset) rather than a slice and a
        view: half the host time, on the path of every gather. ``views``: those views already
        made (``BufferPool.views``, which reuses them for a pool buffer), one per parameter."""
        self.flat = flat
        if views is not None:
            for v, p in zip(views, self.params, strict=True):
                p.data = v
            return
        if flat.dim() != 1 or flat.stride(0) != 1:  # (the pool's and the gathers' buffers are contiguous)
            for s, p in zip(self.slots, self.params):
                p.data = flat[s.offset : s.offset + s.numel].view(s.shape)
            return
        base = flat.storage_offset()
        for (shape, strides, offset), p in zip(self.layout.views, self.params):
            p.data = flat.as_strided(shape, strides, base + offset)

    def release(self) -> None:
        """Drop the full buffer; parameters become empty tensors until the next ``bind`` (one
        empty tensor of the unit's dtype and device, made once: every release is the same)."""
        self.flat = None
        self.state = "free"
        empty = self._empty
        if empty is None:
            empty = self._empty = torch.empty(0, dtype=self.dtype, device=self.device)
        for p in self.params:
            p.data = empty

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Split a full flat buffer into ``{param name: tensor of the param's shape}`` (views)."""
        return unflatten(self.layout, flat)


def unflatten(layout: UnitLayout, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Split a flat buffer (``[numel]`` or longer) of ``layout`` into its parameters (views), each
    under its name and its aliases (a tied weight appears under every name, as in ``state_dict``)."""
    out = {}
    for s in layout.slots:
        v = flat[s.offset : s.offset + s.numel].view(s.shape)
        for n in (s.name, *s.aliases):
            out[n] = v
    return out
