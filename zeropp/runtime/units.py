"""How a model's parameters become units: each parameter's home (a block, or the root), then one
flat unit per block or span of coalesced blocks, one root unit, and (stage 3) one replicated unit
of the parameters under the persistence threshold.

A parameter registered under several names (a tied weight) gets one slot, under its first name,
with the others as its aliases; one registered in two units (two blocks, or a block and a module
outside every block) is placed in the root unit, which stage 3 keeps gathered for the whole
forward and the whole backward. The trainable units (:func:`build_units`) and MixZ++'s frozen
units (``frozen.py``) are built from the same :class:`Homes`, so they group alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from .blocks import BlockPolicy, coalesce_spans, find_blocks, span_name
from .partition import FlatUnit


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


def check_persistence_threshold(model: nn.Module, threshold: int) -> None:
    """Refuse a stage-3 ``persistence_threshold`` above every floating-point parameter of
    ``model`` (frozen ones too): every parameter would stay whole on every rank with its whole
    gradient and optimizer state, stage 0's memory under stage 3's name, and ``offload_param``
    would move nothing (DeepSpeed's default ``stage3_param_persistence_threshold`` of 1e5 does
    that to a small model). The runner refuses the same before any rank starts
    (``experiments/runner/preflight.py::check_persistence``); this is the library's own refusal,
    read off the model alone, so it is the same on every rank and comes before any collective."""
    sizes = {name: p.numel() for name, p in model.named_parameters() if p.is_floating_point()}
    if threshold <= 0 or not sizes:
        return
    name = max(sizes, key=lambda n: sizes[n])
    largest = sizes[name]
    if largest < threshold:
        raise ValueError(
            f"ZeroConfig.persistence_threshold={threshold} is above every parameter of this model (the largest, "
            f"{name!r}, has {largest:,} elements), so stage 3 would keep them all whole on every rank with their "
            f"whole gradients and optimizer state: stage 0's memory under stage 3's name, and offload_param would "
            f"move nothing. Lower persistence_threshold to at most {largest:,} (0 shards every parameter), or use stage=0"
        )


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
