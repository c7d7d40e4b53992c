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

Blocks are chosen by a *policy* (:func:`find_blocks`), like FSDP's auto-wrap policy: module classes
or a ``callable(name, module) -> bool``; the outermost matching modules become the blocks.

Coalescing (``ZeroConfig.coalesce_numel``, :func:`coalesce_spans`): consecutive blocks whose
parameters add up to at most that many elements share one unit (``block<i>-<j>``), so they are
gathered by one all-gather and reduced by one reduce-scatter, as DeepSpeed's stage 3 buckets
parameter fetches and gradient reductions. With 4 ranks on 2 CPU cores each collective is a
scheduling rendezvous of every rank, so fewer, larger collectives are faster there; the price is
a larger gathered buffer (at most ``coalesce_numel`` elements, or one block when a block alone is
larger).

Shared (tied) parameters: one ``Parameter`` registered under several names (GPT-2's token embedding
and output head) gets one slot, under its first name in ``named_parameters()`` with the other
names as :attr:`Slot.aliases`, so it has one shard, one gradient (autograd sums every use into
``p.grad`` once) and one optimizer state. A parameter registered in two units (two blocks, or a
block and a module outside every block) is placed in the root unit: at stage 3 the root is
gathered for the whole forward and the whole backward, so every use finds it present, and its
gradient is reduced after the last use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Sequence, Union, cast

import torch
from torch import nn

KINDS = ("replicated", "sharded_opt", "sharded", "frozen")

BlockPolicy = Union[None, type, Sequence[type], Callable[[str, nn.Module], bool]]
"""How the blocks (stage-3 gather units, stage-2/3 reduction units) are chosen: ``None`` (the
default rule: ``model.blocks`` if it is a ``ModuleList``, else the longest ``ModuleList``, else, for
an ``nn.Sequential`` model, each child that has parameters), a module class or a list of them
(every instance), or ``callable(qualified_name, module) -> bool``."""


class BlockChoiceWarning(UserWarning):
    """Stage 3 would gather every trainable parameter as one unit (see :func:`one_unit_warning`)."""


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


def _describe(policy: BlockPolicy) -> str:
    if isinstance(policy, type):
        return policy.__name__
    if callable(policy):
        return getattr(policy, "__qualname__", None) or repr(policy)
    if policy is None:
        return "None"
    return "[" + ", ".join(getattr(c, "__name__", repr(c)) for c in policy) + "]"


def _matcher(policy: BlockPolicy) -> Callable[[str, nn.Module], bool]:
    """The policy as ``(name, module) -> bool``; a malformed policy is a ``TypeError`` naming it."""
    if isinstance(policy, type):
        policy = (policy,)
    if isinstance(policy, (list, tuple, set, frozenset)):
        classes = tuple(policy)
        bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if bad or not classes:
            raise TypeError(
                f"blocks={_describe(policy)}: a block policy list must hold nn.Module subclasses "
                f"(not {bad or 'nothing'}); or pass callable(name, module) -> bool, or None"
            )
        return lambda name, m: isinstance(m, classes)
    if callable(policy):
        return policy
    raise TypeError(
        f"blocks={policy!r}: use None, a module class, a list of module classes, or callable(name, module) -> bool"
    )


def find_blocks(model: nn.Module, policy: BlockPolicy = None) -> list[nn.Module]:
    """The per-block units, in registration order (assumed to be forward order).

    ``policy=None``: ``model.blocks`` if it is a ``ModuleList``, else the longest ModuleList, else,
    when ``model`` is an ``nn.Sequential`` (a plain stack of layers, run in order), each child
    that has parameters (e.g. each ``Linear`` of an MLP; a parameter-free ``ReLU`` is no block);
    otherwise no blocks (everything is the root). Otherwise, like FSDP's auto-wrap policy, the
    submodules (the model itself excluded) that the policy matches, outermost only: a match inside
    another match belongs to the outer block. A policy that matches nothing is a ``ValueError``
    naming it; it depends only on the model's structure, so every rank raises it alike.
    """
    if policy is None:
        blocks = getattr(model, "blocks", None)
        if isinstance(blocks, nn.ModuleList):
            return list(blocks)
        lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
        if lists:
            longest: nn.ModuleList = max(lists, key=len)
            return list(longest)
        if isinstance(model, nn.Sequential):
            return [m for m in model.children() if next(m.parameters(), None) is not None]
        return []
    match = _matcher(policy)
    found: list[tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if not name or any(name.startswith(outer + ".") for outer, _ in found):
            continue  # the model itself, or inside a block already chosen
        if match(name, m):
            found.append((name, m))
    if not found:
        raise ValueError(
            f"the block policy blocks={_describe(policy)} matches no submodule of "
            f"{type(model).__name__}; pass the class of its repeated layers (e.g. the transformer "
            f"block), a callable(name, module) -> bool that selects them, or blocks=None"
        )
    return [m for _, m in found]


def coalesce_spans(sizes: Sequence[int], coalesce_numel: int) -> list[tuple[int, int]]:
    """Group consecutive blocks: ``sizes[i]`` is block ``i``'s element count; returns inclusive
    ``(first, last)`` block index ranges, in order, covering every block. Greedy from the first
    block: a block joins the running group while the group's total stays ``<= coalesce_numel``;
    a block larger than the threshold is a group of its own. ``coalesce_numel=0``: one group per
    block. Pure, so the engine's units, the frozen units and the communication plan
    (``plan.build_plan``) group alike."""
    if coalesce_numel < 0:
        raise ValueError(f"coalesce_numel must be >= 0, got {coalesce_numel}")
    spans: list[tuple[int, int]] = []
    total = 0
    for i, n in enumerate(sizes):
        if spans and coalesce_numel and total + n <= coalesce_numel:
            spans[-1] = (spans[-1][0], i)
            total += n
        else:
            spans.append((i, i))
            total = n
    return spans


def span_name(first: int, last: int) -> str:
    """The unit name of blocks ``first..last``: ``block<i>`` for one block, ``block<i>-<j>`` for several."""
    return f"block{first}" if first == last else f"block{first}-{last}"


def one_unit_warning(
    model: nn.Module, policy: BlockPolicy, units: Sequence[FlatUnit], *, coalesce_numel: int = 0
) -> str | None:
    """The warning for a stage-3 partition whose one gathered unit holds every trainable parameter
    (``units``: what :func:`build_units` returned), else None.

    Stage 3 saves parameter memory only between gathers: with one unit the whole model is gathered
    for the forward and again for the backward, so the peak holds every parameter, as at stages 0-2.
    It happens silently with the default rule on a model without ``ModuleList`` or ``Sequential``
    structure, or with a policy that matches one module; the text names ``blocks=`` to fix it. When
    the one unit is several blocks merged by ``coalesce_numel`` (a ``block<i>-<j>`` unit), the text
    names that threshold instead."""
    gathered = [u for u in units if u.kind == "sharded"]
    if len(gathered) != 1:
        return None
    u = gathered[0]
    numel = sum(s.numel for s in u.slots)
    if "-" in u.name:  # several blocks, merged by the coalescing threshold
        return (
            f"ZeRO stage 3: coalesce_numel={coalesce_numel:,} merged every block of {type(model).__name__} into one "
            f"unit ({u.name!r}) holding all {numel:,} trainable parameters, gathered whole for the forward and for "
            f"the backward: the peak then holds every parameter, as at stages 0-2. Lower ZeroConfig.coalesce_numel "
            f"(the runner's zero.coalesce_numel) below the model's size, or set it to 0 for one unit per block"
        )
    if policy is None:
        how = (
            f"the default block rule (blocks=None: model.blocks or the longest nn.ModuleList, or the children of "
            f"an nn.Sequential model) found {'no blocks' if u.name == 'root' else 'one block'} in "
            f"{type(model).__name__}"
        )
    else:
        how = f"the block policy blocks={_describe(policy)} leaves one unit in {type(model).__name__}"
    return (
        f"ZeRO stage 3: {how}, so one unit ({u.name!r}) holds all {numel:,} trainable parameters and is "
        f"gathered whole for the forward and for the backward: the peak then holds every parameter, as at "
        f"stages 0-2. Choose the gather units with ZeroEngine(..., blocks=...): a module class or a list of "
        f"them (e.g. blocks=nn.Linear, or the class of the repeated layer), or callable(qualified_name, module) "
        f"-> bool"
    )


def build_units(
    model: nn.Module,
    *,
    stage: int,
    world_size: int,
    rank: int,
    dtype: torch.dtype,
    persistence_threshold: int = 0,
    policy: BlockPolicy = None,
    block_modules: Sequence[nn.Module] | None = None,
    spans: Sequence[tuple[int, int]] | None = None,
) -> tuple[list[FlatUnit], list[tuple[nn.Module, FlatUnit]], FlatUnit | None, FlatUnit | None]:
    """Partition ``model``'s parameters into units.

    Returns ``(all_units, blocks, root_unit, persistent_unit)``; ``blocks`` pairs each block
    module (that has parameters to shard) with its unit, in forward order; ``spans`` (inclusive
    block index ranges, :meth:`Homes.spans`; None: one per block) are coalesced into one unit each,
    whose blocks each appear, with that same unit. The blocks are
    ``block_modules`` when given, else ``find_blocks(model, policy)``. A parameter registered under
    several names gets one slot (the other names are its aliases); one registered in two units
    (two blocks, or a block and a module outside the blocks) goes to the root unit. Frozen
    parameters (``requires_grad=False``) are left out: stages 0-2 keep them replicated, stage 3
    shards them in separate ``frozen`` units (``frozen.build_frozen_units``).
    """
    kind = {0: "replicated", 1: "sharded_opt", 2: "sharded_opt", 3: "sharded"}[stage]
    shards = 1 if kind == "replicated" else world_size
    srank = 0 if kind == "replicated" else rank
    homes = assign_homes(model, block_modules if block_modules is not None else find_blocks(model, policy))
    order, names, home = homes.order, homes.names, homes.home
    ROOT = homes.ROOT
    persistent: list[tuple[str, nn.Parameter]] = []

    def keep(p: nn.Parameter) -> bool:
        if not p.requires_grad:
            return False
        if stage == 3 and p.numel() < persistence_threshold:
            persistent.append((names[id(p)], p))
            return False
        return True

    def unit(name: str, ps: list[nn.Parameter], k: str, n: int, r: int) -> FlatUnit:
        return homes.unit(name, ps, kind=k, num_shards=n, shard_rank=r, dtype=dtype)

    blocks = homes.span_units(
        spans, keep, lambda first, last, ps: unit(span_name(first, last), ps, kind, shards, srank)
    )
    root_ps = [p for p in order if home[id(p)] == ROOT and keep(p)]
    root = unit("root", root_ps, kind, shards, srank) if root_ps else None
    pers = unit("persistent", [p for _, p in persistent], "replicated", 1, 0) if persistent else None
    units = ([root] if root else []) + list(dict.fromkeys(u for _, u in blocks)) + ([pers] if pers else [])
    return units, blocks, root, pers


@dataclass
class Homes:
    """Which unit each parameter belongs to (shared by the trainable and the frozen units)."""

    ROOT = -1
    blocks: list[nn.Module]
    """The distinct block modules, in order (index = the block number in unit names)."""
    order: list[nn.Parameter]
    """Every distinct parameter, in ``named_parameters()`` order."""
    names: dict[int, str]
    """``id(p)`` -> its first (canonical) name."""
    aliases: dict[str, list[str]]
    """Canonical name -> the parameter's other names."""
    home: dict[int, int]
    """``id(p)`` -> its block index, or ``ROOT`` (outside every block, or registered in two units)."""

    def spans(self, coalesce_numel: int) -> list[tuple[int, int]]:
        """The block groups of :func:`coalesce_spans`, sized by each block's floating-point
        parameters (trainable and frozen: at stage 3 both are gathered), counted as
        ``plan.plan_units`` counts them. Read before any parameter is sharded (a sharded
        parameter's ``data`` is empty): the engine takes them once, for its trainable and frozen units."""
        sizes = [0] * len(self.blocks)
        for p in self.order:
            i = self.home[id(p)]
            if i != self.ROOT and p.is_floating_point():
                sizes[i] += p.numel()
        return coalesce_spans(sizes, coalesce_numel)

    def span_units(
        self,
        spans: Sequence[tuple[int, int]] | None,
        select: Callable[[nn.Parameter], bool],
        make: Callable[[int, int, list[nn.Parameter]], FlatUnit],
    ) -> list[tuple[nn.Module, FlatUnit]]:
        """One unit per span of ``spans`` (inclusive block ranges, :meth:`spans`; None: one per block)
        that has parameters ``select`` keeps, built by ``make(first, last, params)``, paired with each
        block of the span that holds a parameter of any kind (the blocks whose stage-3 hooks find the
        unit; a block without parameters needs none). The trainable and the frozen units are built
        by this one loop, so they group alike."""
        held = {self.home[id(p)] for p in self.order}
        out: list[tuple[nn.Module, FlatUnit]] = []
        for first, last in spans if spans is not None else self.spans(0):
            span = range(first, last + 1)
            ps = [p for p in self.order if self.home[id(p)] in span and select(p)]
            if ps:
                u = make(first, last, ps)
                out.extend((self.blocks[i], u) for i in span if i in held)
        return out

    def unit(
        self, name: str, ps: list[nn.Parameter], *, kind: str, num_shards: int, shard_rank: int, dtype: torch.dtype
    ) -> FlatUnit:
        named = [(self.names[id(p)], p) for p in ps]
        return FlatUnit.build(
            name,
            named,
            kind=kind,
            num_shards=num_shards,
            shard_rank=shard_rank,
            dtype=dtype,
            aliases={nm: self.aliases[nm] for nm, _ in named if self.aliases[nm]},
        )


def assign_homes(model: nn.Module, blocks: Sequence[nn.Module]) -> Homes:
    """Place every parameter of ``model``: in the block whose qualified name prefixes its name,
    else (or when registered in two units) in the root; tied names become aliases."""
    block_list: list[nn.Module] = []
    for b in blocks:
        if all(b is not c for c in block_list):  # a module listed twice (e.g. reused in a ModuleList) is one block
            block_list.append(b)
    index_of = {id(b): i for i, b in enumerate(block_list)}
    # every qualified name of every block module (a module registered twice has two)
    block_index = {n: index_of[id(m)] for n, m in model.named_modules(remove_duplicate=False) if id(m) in index_of}
    ROOT = Homes.ROOT

    def owner(param_name: str) -> int:
        parts = param_name.split(".")[:-1]
        for k in range(1, len(parts) + 1):  # outermost prefix first
            i = block_index.get(".".join(parts[:k]))
            if i is not None:
                return i
        return ROOT

    names: dict[int, str] = {}  # id -> first (canonical) name
    aliases: dict[str, list[str]] = {}
    owners: dict[int, set[int]] = {}
    order: list[nn.Parameter] = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in names:
            aliases[names[id(p)]].append(name)
        else:
            names[id(p)], aliases[name] = name, []
            order.append(p)
        owners.setdefault(id(p), set()).add(owner(name))
    home = {id(p): (ROOT if len(owners[id(p)]) > 1 else next(iter(owners[id(p)]))) for p in order}
    return Homes(blocks=block_list, order=order, names=names, aliases=aliases, home=home)
