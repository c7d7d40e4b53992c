"""One training step's communication, declared once: :class:`CommPlan` and :func:`build_plan`.

Why: the engine decides what each step sends, and the byte and time models
(``experiments.projection.scaling``, ``experiments.projection.step_schedule``) need the same schedule. A pure function of
shapes and settings -- the units' element counts (:class:`PlanUnit`, from a model on the meta device
by :func:`plan_units`), the ``ZeroConfig`` and the ``Topology`` -- builds it, with no process group
and no weights, so a model of any size can be planned in milliseconds; the models read it instead of
restating it, and the tests check it against the engine's own ``CommStats``.

What the plan holds: every collective of one step in issue order (:class:`Collective`): its kind
(``CommStats`` key), group, algorithm, the bytes this rank sends to each peer and so per link class,
its QuantSpec and bits, bucket chunk, unit and micro-batch, and its dependencies on compute: the
compute task (:attr:`CommPlan.compute`) it is issued before and the first one that waits for it,
which is what overlaps it (stage 3 prefetches ``prefetch_depth`` blocks ahead).

The step it describes is the steady state (any step after the first): from the second step on, qWD
and frozen units under hpZ keep their hpZ secondary copies, so their gathers stay inside the hpZ
group; every other setting sends the same in every step. The rules (what the engine does):

* units are padded to the data-parallel world ``W`` (``shard = ceil(numel / W)``) and a gather or
  reduce-scatter larger than its bucket is cut by :func:`~.plan_kinds.chunk_ranges`, each chunk one
  call with its own quantization scales;
* stage 3: per micro-batch a forward and a backward gather of every unit over the world (qwZ:
  ``ZeroConfig.weights``); with hpZ only the first forward of the step gathers over the world, every
  other gather reads the secondary inside the hpZ group: with qwZ (a unit gathered in one call, no
  qWD) its ``W / h`` wire rows, else the full-precision ``W * shard / h`` elements;
  with qWD every gather reads the secondary and one quantized difference gather per unit over the
  world follows the optimizer step; ``ZeroConfig.keep_at_turn`` drops the backward gathers of the
  root and the last block's unit (still gathered from forward);
* frozen units (stage 3) are gathered with their block's trainable unit, under
  ``frozen_all_gather``: like trainable ones, or (MixZ++, ``quantize_frozen=int8|int4``) as their
  stored wire row, one call per unit; under hpZ always from the secondary;
* gradients: stage 0 all-reduces each whole unit once after the last backward; stages 1-3
  reduce-scatter (stages 2-3: each unit after its backward, every micro-batch; stage 1 once); qgZ is
  an intra-node all-to-all of ``nodes`` rows per local peer then a cross-node all-to-all of one
  requantized row per node (a single hop when the world has one node, or one rank per node);
* stages 1-2 gather the updated parameters after the step (qWD: the quantized differences);
* control: one scalar all-reduce per micro-batch and one at the end, uncounted (``counted=False``);
* tensor parallelism (``Topology.tp``): ZeRO runs over the ``W / tp`` data-parallel ranks with the
  units' TP-local element counts; the TP plans' own activation collectives are not in the plan.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Collection, Iterable, Sequence

from zeropp.comm import ranges
from zeropp.comm.codecs import codec_for
from zeropp.comm.spec import QuantSpec
from zeropp.comm.topology import Topology

from .config import ZeroConfig
from .plan_kinds import Algo, CommKind, Group, Link, Phase, chunk_ranges, group_size_of

if TYPE_CHECKING:
    from torch import nn

    from .blocks import BlockPolicy

CONTROL_BYTES = 16
"""Bytes of a control all-reduce (two fp64 scalars)."""
FROZEN_BITS = {"none": None, "int8": 8, "int4": 4}
"""``ZeroConfig.quantize_frozen`` -> code width (as ``frozen.BITS``)."""


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


def _wire(spec: QuantSpec | None, cols: int, bits: int | None, dtype_bytes: int, *, weights: bool) -> int:
    """Bytes of one row of ``cols`` elements: the spec's codec row, or the compute dtype's."""
    if spec is None:
        return cols * dtype_bytes
    return codec_for(spec).wire_bytes(cols, bits or spec.bits, group_size_of(spec, weights=weights))


class _Builder:
    """Emits one step's collectives in the engine's issue order (module doc)."""

    def __init__(self, units: Sequence[PlanUnit], cfg: ZeroConfig, topo: Topology) -> None:
        if cfg.persistence_threshold:
            raise ValueError(
                f"ZeroConfig.persistence_threshold={cfg.persistence_threshold} is not planned (its "
                f"parameters form an all-reduced replicated unit); plan with persistence_threshold=0"
            )
        if cfg.hpz_size is not None:
            topo = dataclasses.replace(topo, hpz_size=cfg.hpz_size)  # as the engine does
        self.units, self.cfg = tuple(units), cfg
        self.N, self.R = topo.nodes, topo.ranks_per_node // topo.tp
        self.W, self.h = self.N * self.R, topo.hpz_group_size // topo.tp
        self.full_ranks = topo.ranks_per_node
        self.db = cfg.dtype.itemsize
        bits = FROZEN_BITS[cfg.quantize_frozen]
        gs = cfg.weights.group_size if cfg.weights else None
        self.frozen_spec = (
            None
            if bits is None
            else QuantSpec(bits=bits, group_size=group_size_of(QuantSpec(bits=bits, group_size=gs), weights=True))
        )
        self.compute: list[ComputeTask] = []
        self.out: list[Collective] = []

    # ---------------------------------------------------------------- one unit's calls
    def shard(self, numel: int) -> int:
        return -(-numel // self.W)

    def gather(self, kind: CommKind, phase: Phase, mb: int, ui: int, *, frozen: bool, issued: int, needed: int) -> None:
        """A stage-3 gather of unit ``ui`` (its trainable or frozen part)."""
        u, cfg, N, R, h = self.units[ui], self.cfg, self.N, self.R, self.h
        numel = u.frozen if frozen else u.numel
        if not numel:
            return
        s = self.shard(numel)
        common = dict(
            kind=kind, phase=phase, micro_batch=mb, unit=ui, frozen=frozen, issued_before=issued, needed_by=needed
        )
        first_fwd = phase == Phase.FWD and mb == 0
        from_secondary = cfg.hpz and (frozen or cfg.weight_diff is not None or not first_fwd)
        spec: QuantSpec | None
        if frozen and self.frozen_spec is not None:  # MixZ++: the stored wire row, one call, never re-cut
            b = _wire(self.frozen_spec, s, None, self.db, weights=True)
            spec, bits = self.frozen_spec, self.frozen_spec.bits
            if from_secondary:  # this member's share of the world's rows
                self.add(
                    algo=Algo.RING_AG,
                    group=Group.HPZ,
                    bucket=0,
                    columns=s,
                    spec=spec,
                    bits=bits,
                    nodes=1,
                    ranks=h,
                    peer_bytes=self.W // h * b,
                    **common,
                )
            else:
                self.add(
                    algo=Algo.RING_AG,
                    group=Group.WORLD,
                    bucket=0,
                    columns=s,
                    spec=spec,
                    bits=bits,
                    nodes=N,
                    ranks=R,
                    peer_bytes=b,
                    **common,
                )
            return
        rows = not frozen and self._keeps_rows(s)
        if from_secondary and rows:  # qwZ + hpZ: this member's share of the world's wire rows, one call
            assert cfg.weights is not None
            self.add(
                algo=Algo.RING_AG,
                group=Group.HPZ,
                bucket=0,
                columns=s,
                spec=cfg.weights,
                bits=cfg.weights.bits,
                nodes=1,
                ranks=h,
                peer_bytes=self.W // h * _wire(cfg.weights, s, None, self.db, weights=True),
                **common,
            )
            return
        if from_secondary:
            cols, spec, group, nodes, ranks = self.W * s // h, None, Group.HPZ, 1, h
        else:
            cols, spec, group, nodes, ranks = s, cfg.weights, Group.WORLD, N, R
        for k, (a, b) in enumerate(chunk_ranges(cols, nodes * ranks, cfg.allgather_bucket_size)):
            self.add(
                algo=Algo.RING_AG,
                group=group,
                bucket=k,
                columns=b - a,
                spec=spec,
                bits=spec.bits if spec else None,
                nodes=nodes,
                ranks=ranks,
                peer_bytes=_wire(spec, b - a, None, self.db, weights=True),
                **common,
            )

    def _keeps_rows(self, s: int) -> bool:
        """Whether hpZ keeps a trainable unit's secondary as qwZ's wire rows (``gathers.UnitGathers.keeps_rows``)."""
        cfg = self.cfg
        return (
            cfg.hpz
            and cfg.weights is not None
            and cfg.weight_diff is None
            and len(chunk_ranges(s, self.W, cfg.allgather_bucket_size)) == 1
        )

    def refresh(self, ui: int, issued: int) -> None:
        """Stages 1-2's parameter gather, or qWD's difference gather, of unit ``ui`` after the step."""
        numel, cfg = self.units[ui].numel, self.cfg
        if not numel:
            return
        spec = cfg.weight_diff
        kind = CommKind.PARAM_ALL_GATHER if spec is None else CommKind.WEIGHT_DIFF_ALL_GATHER
        s = self.shard(numel)
        for k, (a, b) in enumerate(chunk_ranges(s, self.W, cfg.allgather_bucket_size)):
            self.add(
                kind=kind,
                algo=Algo.RING_AG,
                group=Group.WORLD,
                phase=Phase.POST,
                micro_batch=-1,
                unit=ui,
                frozen=False,
                bucket=k,
                columns=b - a,
                spec=spec,
                bits=spec.bits if spec else None,
                nodes=self.N,
                ranks=self.R,
                peer_bytes=_wire(spec, b - a, None, self.db, weights=True),
                issued_before=issued,
                needed_by=issued,
            )

    def reduce(self, ui: int, mb: int, issued: int, needed: int) -> None:
        """Unit ``ui``'s gradient reduction (stage 0: all-reduce; else reduce-scatter, qgZ's hops)."""
        numel, cfg, N, R, W = self.units[ui].numel, self.cfg, self.N, self.R, self.W
        if not numel:
            return
        common = dict(
            kind=CommKind.GRAD_REDUCE_SCATTER,
            phase=Phase.REDUCE,
            micro_batch=mb,
            unit=ui,
            frozen=False,
            issued_before=issued,
            needed_by=needed,
        )
        if cfg.stage == 0:
            self.add(
                **{**common, "kind": CommKind.GRAD_ALL_REDUCE},
                algo=Algo.ALL_REDUCE,
                group=Group.WORLD,
                bucket=0,
                columns=numel,
                spec=None,
                bits=None,
                nodes=N,
                ranks=R,
                peer_bytes=2 * numel * self.db // W,
            )
            return
        g = cfg.grads
        for k, (a, b) in enumerate(chunk_ranges(self.shard(numel), W, cfg.reduce_bucket_size)):
            cols = b - a
            if g is None:
                self.add(
                    algo=Algo.RING_RS,
                    group=Group.WORLD,
                    bucket=k,
                    columns=cols,
                    spec=None,
                    bits=None,
                    nodes=N,
                    ranks=R,
                    peer_bytes=cols * self.db,
                    **common,
                )
                continue
            ib, cb = g.hop_bits
            row_i = _wire(g, cols, ib, self.db, weights=False)
            row_c = _wire(g, cols, cb, self.db, weights=False)
            if N == 1 or R > 1:  # intra hop: each local peer gets the N rows it reduces
                self.add(
                    algo=Algo.A2A_INTRA,
                    group=Group.INTRA,
                    bucket=k,
                    columns=cols,
                    spec=g,
                    bits=ib,
                    nodes=1,
                    ranks=R,
                    peer_bytes=N * row_i,
                    **common,
                )
            if N > 1:  # cross hop: one requantized row to each node's same-local-rank peer
                self.add(
                    algo=Algo.A2A_CROSS,
                    group=Group.CROSS,
                    bucket=k,
                    columns=cols,
                    spec=g,
                    bits=cb,
                    nodes=N,
                    ranks=1,
                    peer_bytes=row_c,
                    **common,
                )

    def add(self, **kw: object) -> None:
        self.out.append(Collective(**kw))  # type: ignore[arg-type]

    def control(self, mb: int, issued: int) -> None:
        if self.N * self.full_ranks > 1:
            self.add(
                kind=CommKind.CONTROL,
                algo=Algo.ALL_REDUCE,
                group=Group.DEFAULT,
                phase=Phase.CONTROL,
                micro_batch=mb,
                unit=-1,
                frozen=False,
                bucket=0,
                columns=CONTROL_BYTES // 8,
                spec=None,
                bits=None,
                nodes=self.N,
                ranks=self.full_ranks,
                peer_bytes=CONTROL_BYTES,
                counted=False,
                issued_before=issued,
                needed_by=issued,
            )

    # ---------------------------------------------------------------- the step
    def task(self, phase: Phase, mb: int, unit: int) -> int:
        self.compute.append(ComputeTask(phase=phase, micro_batch=mb, unit=unit))
        return len(self.compute) - 1

    def step(self) -> None:
        """The engine's issue order (module doc; ``experiments.projection.step_schedule`` replays it in time)."""
        cfg, a = self.cfg, self.cfg.grad_accum_steps
        blocks = list(range(1, len(self.units)))
        for mb in range(a):
            fwd = {ui: self.task(Phase.FWD, mb, ui) for ui in [*blocks, 0]}
            bwd = {ui: self.task(Phase.BWD, mb, ui) for ui in [0, *reversed(blocks)]}
            end = len(self.compute)  # the next micro-batch's first task, or the optimizer step
            if cfg.stage == 3:
                self.gathered(
                    CommKind.FWD_ALL_GATHER, Phase.FWD, mb, blocks, fwd, first=fwd[blocks[0]] if blocks else fwd[0]
                )
            self.control(mb, bwd[0])
            order = list(reversed(blocks))
            if cfg.stage == 3:
                self.gathered(
                    CommKind.BWD_ALL_GATHER,
                    Phase.BWD,
                    mb,
                    order,
                    bwd,
                    first=bwd[0],
                    reduce_end=end if cfg.stage >= 2 else None,
                    kept=self.kept_at_turn(order),
                )
            elif cfg.stage == 2:
                for ui in order:
                    self.reduce(ui, mb, bwd[ui] + 1, end)
            if cfg.stage >= 2:
                self.reduce(0, mb, end, end)
        opt = self.task(Phase.POST, -1, -1)
        if cfg.stage < 2:  # every unit once, after the last backward, in backward order
            for ui in [*reversed(blocks), 0]:
                self.reduce(ui, -1, opt, opt)
        self.control(-1, opt)
        if cfg.stage in (1, 2) or cfg.weight_diff is not None:
            for ui in range(len(self.units)):
                self.refresh(ui, opt + 1)

    def kept_at_turn(self, order: list[int]) -> tuple[int, ...]:
        """The units ``ZeroConfig.keep_at_turn`` keeps gathered into backward: the root and the last
        block unit the engine has (one with parameters: an empty block is no engine unit)."""
        if not self.cfg.keep_at_turn:
            return ()
        last = next((ui for ui in order if self.units[ui].numel + self.units[ui].frozen > 0), None)
        return (0,) if last is None else (0, last)

    def gathered(
        self,
        kind: CommKind,
        phase: Phase,
        mb: int,
        order: list[int],
        tasks: dict[int, int],
        *,
        first: int,
        reduce_end: int | None = None,
        kept: Collection[int] = (),
    ) -> None:
        """One stage-3 pass (``experiments.projection.step_schedule._gathered`` replays it): the root's gather,
        issued and waited before ``first``; the gathers of the first ``prefetch_depth`` blocks of
        ``order``; then per block: its own gather (unless prefetched), the next ``prefetch_depth``
        blocks' gathers before its compute, and (``reduce_end``) its reduce-scatter after it.
        ``kept``: units still gathered from forward (``ZeroConfig.keep_at_turn``), whose gathers
        are not issued (a prefetch of one is a no-op in the engine too)."""
        p, done = self.cfg.prefetch_depth, set()

        def issue(j: int, at: int) -> None:
            if j < len(order) and j not in done:
                done.add(j)
                if order[j] not in kept:
                    self.gathers(kind, phase, mb, order[j], at, tasks[order[j]])

        if 0 not in kept:
            self.gathers(kind, phase, mb, 0, first, first)
        for j in range(p):
            issue(j, first)
        for r, ui in enumerate(order):
            for j in range(r, r + 1 + p):
                issue(j, tasks[ui])
            if reduce_end is not None:
                self.reduce(ui, mb, tasks[ui] + 1, reduce_end)

    def gathers(self, kind: CommKind, phase: Phase, mb: int, ui: int, issued: int, needed: int) -> None:
        """Unit ``ui``'s stage-3 gather: its trainable part, then its frozen part."""
        self.gather(kind, phase, mb, ui, frozen=False, issued=issued, needed=needed)
        self.gather(CommKind.FROZEN_ALL_GATHER, phase, mb, ui, frozen=True, issued=issued, needed=needed)


def build_plan(units: Iterable[PlanUnit | int], zero: ZeroConfig, topology: Topology) -> CommPlan:
    """The plan of one steady-state training step of ``units`` (root first, then the blocks in forward
    order; bare element counts mean trainable units without frozen parts) under ``zero`` on
    ``topology``; blocks are coalesced by ``zero.coalesce_numel`` as the engine coalesces them
    (:func:`coalesce_units`). Pure: no process group, no tensors."""
    us = tuple(
        u if isinstance(u, PlanUnit) else PlanUnit(name="root" if i == 0 else f"block{i - 1}", numel=int(u))
        for i, u in enumerate(units)
    )
    if not us:
        raise ValueError("build_plan: no units; give the root's and each block's element counts")
    us = coalesce_units(us, zero.coalesce_numel)
    if any(u.frozen for u in us) and zero.stage != 3:
        us = tuple(dataclasses.replace(u, frozen=0) for u in us)  # stages 0-2 keep frozen parameters replicated
    b = _Builder(us, zero, topology)
    b.step()
    return CommPlan(
        units=us,
        compute=tuple(b.compute),
        collectives=tuple(b.out),
        stage=zero.stage,
        micro_batches=zero.grad_accum_steps,
        prefetch_depth=zero.prefetch_depth,
        world=b.W,
        nodes=b.N,
        ranks_per_node=b.R,
        hpz_size=b.h,
        dtype_bytes=b.db,
    )


def coalesce_units(units: Sequence[PlanUnit], coalesce_numel: int) -> tuple[PlanUnit, ...]:
    """``units`` (root first, then one per block) with consecutive blocks merged as the engine
    merges them under ``ZeroConfig.coalesce_numel`` (``blocks.coalesce_spans``, sized by
    trainable plus frozen elements): one unit ``block<i>-<j>`` per group of several blocks."""
    from .blocks import coalesce_spans, span_name

    root, blocks = units[0], units[1:]
    if not coalesce_numel or len(blocks) < 2:
        return tuple(units)
    merged = [root]
    for first, last in coalesce_spans([u.numel + u.frozen for u in blocks], coalesce_numel):
        span = blocks[first : last + 1]
        name = span[0].name if first == last else span_name(first, last)
        merged.append(PlanUnit(name=name, numel=sum(u.numel for u in span), frozen=sum(u.frozen for u in span)))
    return tuple(merged)


def plan_units(model: nn.Module, blocks: BlockPolicy = None) -> tuple[PlanUnit, ...]:
    """The units the engine would build for ``model`` (root first, then each block of
    ``blocks.find_blocks(model, blocks)``), as element counts: trainable floating-point
    parameters, and frozen ones (``requires_grad=False``) separately. Reads shapes only, so ``model``
    may live on the meta device; a model already split by tensor parallelism gives TP-local counts."""
    from .blocks import find_blocks
    from .units import Homes, assign_homes

    homes = assign_homes(model, find_blocks(model, blocks))
    counts = {i: [0, 0] for i in [Homes.ROOT, *range(len(homes.blocks))]}
    for p in homes.order:
        if p.is_floating_point():
            counts[homes.home[id(p)]][0 if p.requires_grad else 1] += p.numel()
    names = {Homes.ROOT: "root", **{i: f"block{i}" for i in range(len(homes.blocks))}}
    return tuple(PlanUnit(name=names[i], numel=n, frozen=f) for i, (n, f) in counts.items())
