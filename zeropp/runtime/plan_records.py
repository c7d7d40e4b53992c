"""The records of a step's communication plan: :class:`PlanUnit` (a unit's element counts),
:class:`ComputeTask`, :class:`Collective` (one call) and :class:`CommPlan` (the whole step).

Why a module of their own: :mod:`.plan_builder` emits them and :mod:`.plan` assembles them, while
the byte and time models (``experiments.projection``) only read them; plain frozen dataclasses
with their per-link byte accounting, no rule of which calls a step issues.
"""

from __future__ import annotations

import dataclasses

from zeropp.comm import ranges
from zeropp.comm.spec import QuantSpec

from .plan_kinds import Algo, CommKind, Group, Link, Phase

CONTROL_BYTES = 16
"""Bytes of a control all-reduce (two fp64 scalars)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanUnit:
    """One communication unit's element counts (per rank: TP-local under tensor parallelism)."""

    name: str
    """``root``, ``block<i>``, or ``block<i>-<j>`` (blocks i..j coalesced, :func:`coalesce_units`)."""
    numel: int
    """Trainable elements (0: the unit has no trainable parameters)."""
    frozen: int = 0
    """Frozen elements: a stage-3 frozen unit gathered with it (0: none)."""

    def __post_init__(self) -> None:
        if self.numel < 0 or self.frozen < 0:
            raise ValueError(
                f"PlanUnit {self.name!r}: numel={self.numel}, frozen={self.frozen}; give element counts >= 0"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ComputeTask:
    """A piece of a step's compute, in the order the engine runs them."""

    phase: Phase
    """``fwd``, ``bwd`` or ``post`` (the optimizer step)."""
    micro_batch: int
    """Micro-batch index (-1: the optimizer step)."""
    unit: int
    """Index into :attr:`CommPlan.units` (-1: the optimizer step)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Collective:
    """One call of one collective of the step."""

    kind: CommKind
    """What it is (the ``CommStats`` key)."""
    algo: Algo
    """How it moves its bytes."""
    group: Group
    """The group it runs over."""
    phase: Phase
    """Where in the step it is issued."""
    micro_batch: int
    """Micro-batch it belongs to (-1: once per step)."""
    unit: int
    """Index into :attr:`CommPlan.units` of the unit it moves (-1: control)."""
    frozen: bool
    """It moves the unit's frozen part."""
    bucket: int
    """Chunk index within the unit's collective (0 when not cut)."""
    columns: int
    """Elements per row of this chunk (a row is what one rank contributes or receives)."""
    spec: QuantSpec | None
    """The quantization of this call (None: the compute dtype)."""
    bits: int | None
    """Code width on this hop (qgZ: intra or cross bits)."""
    nodes: int
    """Nodes the group spans."""
    ranks: int
    """Group members per node."""
    peer_bytes: int
    """Bytes this rank sends to each peer (all-reduce: both halves)."""
    counted: bool = True
    """Recorded by ``CommStats`` (control scalars are not)."""
    issued_before: int = 0
    """Index into :attr:`CommPlan.compute` of the task it is issued before (``len(compute)``: at the end)."""
    needed_by: int = 0
    """Index into :attr:`CommPlan.compute` of the first task that waits for it (``len(compute)``: the
    step's end)."""

    def link_bytes(self) -> dict[Link, int]:
        """Bytes this rank sends per link class (``CommStats``' pairwise accounting)."""
        if self.algo == Algo.A2A_CROSS:
            intra, cross = 0, self.nodes - 1
        else:
            intra, cross = self.ranks - 1, (self.nodes - 1) * self.ranks
        return {Link.INTRA: intra * self.peer_bytes, Link.CROSS: cross * self.peer_bytes}


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommPlan:
    """Every collective of one (steady-state) training step, in issue order."""

    units: tuple[PlanUnit, ...]
    """The units, root first."""
    compute: tuple[ComputeTask, ...]
    """The compute tasks, in the order they run."""
    collectives: tuple[Collective, ...]
    """The collectives, in issue order."""
    stage: int
    """ZeRO stage."""
    micro_batches: int
    """Micro-batches per step."""
    prefetch_depth: int
    """Stage 3: blocks gathered ahead of the one computing."""
    world: int
    """ZeRO's data-parallel world (``W / tp``)."""
    nodes: int
    """Nodes."""
    ranks_per_node: int
    """Data-parallel ranks per node (``ranks_per_node / tp``)."""
    hpz_size: int
    """Data-parallel ranks of a hpZ group."""
    dtype_bytes: int
    """Bytes per unquantized element on the wire."""

    def bytes_by_kind(self) -> dict[str, int]:
        """Counted bytes this rank sends per step, ``{"<kind>.<link>": bytes}`` (nonzero entries):
        what ``CommStats`` records."""
        out: dict[str, int] = {}
        for c in self.collectives:
            if c.counted:
                for link, b in c.link_bytes().items():
                    if b:
                        key = f"{c.kind}.{link}"
                        out[key] = out.get(key, 0) + b
        return out

    def range_name(self, c: Collective) -> str:
        """The profiler range the engine runs ``c`` in (``zeropp.comm.ranges``):
        ``zeropp/<kind>/<unit>/b<bucket>`` (a frozen part's unit ``<unit>.frozen``), a qgZ hop
        suffixed ``/intra`` or ``/cross``, a control all-reduce ``zeropp/control``."""
        if c.kind == CommKind.CONTROL:
            return ranges.call_name(c.kind)
        unit = self.units[c.unit].name + (".frozen" if c.frozen else "")
        hop = {Algo.A2A_INTRA: "intra", Algo.A2A_CROSS: "cross"}.get(c.algo)
        return ranges.call_name(c.kind, unit, c.bucket, hop)

    def total_bytes(self) -> int:
        """Counted bytes this rank sends per step, every kind and link."""
        return sum(self.bytes_by_kind().values())
