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

The rules (which calls a step issues, in what order, at what size) live in :mod:`.plan_builder`;
the records (:class:`PlanUnit`, :class:`ComputeTask`, :class:`Collective`, :class:`CommPlan`) in
:mod:`.plan_records`. Both are re-exported here, the import path of the plan.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Iterable, Sequence

from zeropp.comm.topology import Topology

from .config import ZeroConfig
from .plan_builder import FROZEN_BITS, StepBuilder, wire_row_bytes
from .plan_records import CONTROL_BYTES, Collective, CommPlan, ComputeTask, PlanUnit

if TYPE_CHECKING:
    from torch import nn

    from .blocks import BlockPolicy

__all__ = [
    "CONTROL_BYTES",
    "FROZEN_BITS",
    "Collective",
    "CommPlan",
    "ComputeTask",
    "PlanUnit",
    "StepBuilder",
    "build_plan",
    "coalesce_units",
    "plan_units",
    "wire_row_bytes",
]


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
    b = StepBuilder(us, zero, topology)
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
