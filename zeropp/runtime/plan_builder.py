"""The rules of one training step's communication: :class:`StepBuilder` emits every collective of
a steady-state step in the engine's issue order, which :func:`.plan.build_plan` wraps into a
:class:`~.plan_records.CommPlan`.

Why apart from :mod:`.plan`: these are the engine's rules restated over element counts (pure, no
process group, no tensors), the part that must change with the engine; the plan's records and its
entry points stay put.

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
from typing import Collection, Sequence

from zeropp.comm.codecs import codec_for
from zeropp.comm.spec import QuantSpec
from zeropp.comm.topology import Topology

from .config import ZeroConfig
from .plan_kinds import Algo, CommKind, Group, Phase, chunk_ranges, group_size_of
from .plan_records import CONTROL_BYTES, Collective, ComputeTask, PlanUnit

FROZEN_BITS = {"none": None, "int8": 8, "int4": 4}
"""``ZeroConfig.quantize_frozen`` -> code width (as ``frozen.BITS``)."""


def wire_row_bytes(spec: QuantSpec | None, cols: int, bits: int | None, dtype_bytes: int, *, weights: bool) -> int:
    """Bytes of one row of ``cols`` elements: the spec's codec row, or the compute dtype's."""
    if spec is None:
        return cols * dtype_bytes
    return codec_for(spec).wire_bytes(cols, bits or spec.bits, group_size_of(spec, weights=weights))


class StepBuilder:
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
            b = wire_row_bytes(self.frozen_spec, s, None, self.db, weights=True)
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
                peer_bytes=self.W // h * wire_row_bytes(cfg.weights, s, None, self.db, weights=True),
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
                peer_bytes=wire_row_bytes(spec, b - a, None, self.db, weights=True),
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
                peer_bytes=wire_row_bytes(spec, b - a, None, self.db, weights=True),
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
            row_i = wire_row_bytes(g, cols, ib, self.db, weights=False)
            row_c = wire_row_bytes(g, cols, cb, self.db, weights=False)
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
