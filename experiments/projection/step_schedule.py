"""Overlap in the step-time model: one training step as a list schedule on two resources.

Why: :func:`experiments.projection.scaling.project` adds compute and communication (minus a free
``overlap`` fraction), but the engine overlaps them by construction -- stage 3 issues the gathers
of the next ``prefetch_depth`` blocks before the current block computes, and stages 2-3 keep each
block's gradient reduce-scatter in flight while the blocks before it run backward. On the
emulated cluster that made the serial formula overstate ZeRO-3 at 1 Gbit/s by 16%
(docs/benchmarks.md). This module replays the engine's issue order instead.

Two resources, each working through its tasks in issue order:

* **compute** -- the rank's forward and backward, and the communication work that occupies the
  same processor: quantization kernels always; on CPU ranks (``Cluster.comm_on_compute``, the
  emulator) also each collective's per-message latency and the copy of every byte it sends,
  since gloo and the kernel's loopback / veth copy on the same cores that compute;
* **link** -- the transfers, one at a time (one uplink per node / one communication stream): the
  cross-node time of each collective, and on GPUs (``comm_on_compute=False``) its whole alpha-beta
  time (:func:`~experiments.projection.scaling.collective_time`).

A collective issued at time ``t`` first quantizes (compute), then its other compute-side part and
its link part run at once; it is done when both are. A block's compute waits for its gather; the
step ends when every reduce-scatter and the post-step refresh (stages 1-2's parameter gather,
qWD's difference gather) are done. Compute is split 1/3 forward, 2/3 backward
(:data:`FORWARD_SHARE`), over the units in proportion to their elements; the root unit
(embeddings, head) runs its forward after the blocks' and its backward before them, as the
head dominates it. Issue order, per micro-batch (stage 3): root gather, wait, gathers of blocks
``0..p-1``; for each block ``i``: wait its gather, issue block ``i + p``'s, compute. Backward:
the root's gather and compute, then blocks last to first the same way, each followed by its
reduce-scatter; the root's reduce-scatter last (``keep_at_turn``: the root's and the last
block's backward gathers are not sent, the plan has none). Stage 2 reduce-scatters in backward, stages 0-1
all-reduce / reduce-scatter every unit after the last backward.

What it leaves out: the limit on reduce-scatters in flight, dequantization's place after the
transfer (charged at issue), the optimizer's own time (inside ``compute_s``), activation
checkpointing's recompute (a larger backward share), and on CPU ranks the slowdown of a transfer
while the ranks compute (gloo forwards a ring's chunks on the cores that compute): on the 2-core
emulator a lone ZeRO-3 gather ran ~8% longer than its bytes at the probed rate, though gloo's ring
alone gets 98-99% of it (``ring_probe.py``), so link-bound ZeRO-3 reads ~10% fast there.

``python -m experiments.step_schedule`` prints ``python -m experiments.scaling``'s projection
table (same options) with scheduled step times.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import NoReturn

from zeropp.runtime.plan_kinds import Phase

from ..launch.command import run_command
from .scaling import (
    Projection,
    collective_time,
    control_time,
    link_terms,
    messages,
    node_cross_bytes,
    pairwise_bytes,
    quant_time,
    uplink_bytes,
)
from .spec import GBPS, Cluster, Message, Workload

FORWARD_SHARE = 1.0 / 3.0
"""Share of a step's compute spent in forward (backward is about twice the forward's FLOPs)."""


@dataclasses.dataclass(frozen=True)
class Transfer:
    """The cost of one unit's collectives at one point of a micro-batch."""

    quant_s: float = 0.0
    """Quantization kernels on the compute resource, before the transfer can start."""
    compute_s: float = 0.0
    """Other seconds on the compute resource, alongside the transfer (CPU ranks: latency, copies)."""
    link_s: float = 0.0
    """Seconds on the link resource."""

    def __add__(self, o: Transfer) -> Transfer:
        return Transfer(self.quant_s + o.quant_s, self.compute_s + o.compute_s, self.link_s + o.link_s)

    def __mul__(self, k: float) -> Transfer:
        return Transfer(self.quant_s * k, self.compute_s * k, self.link_s * k)


NONE = Transfer()


@dataclasses.dataclass(frozen=True)
class UnitCosts:
    """One communication unit's compute and transfers per micro-batch (post: per step)."""

    fwd_s: float
    bwd_s: float
    fwd: Transfer = NONE
    bwd: Transfer = NONE
    reduce: Transfer = NONE
    post: Transfer = NONE


def message_transfer(m: Message, c: Cluster) -> Transfer:
    """One call of ``m``. GPUs: all of it on the link (latency and the slower of the intra- and
    cross-node transfers, :func:`~experiments.projection.scaling.collective_time`). CPU ranks
    (``c.comm_on_compute``): the latency and a copy of every byte this rank sends, at
    ``c.intra_gbps`` (loopback, or the veth in front of the shaped uplink), on the compute side;
    the cross-node transfer on the link."""
    if not c.comm_on_compute:
        return Transfer(link_s=collective_time(m, c))
    steps, t_cross, sent = link_terms(m, c)  # ring / intra all-to-all: every chunk this rank sends
    if m.algo == "a2a_cross":
        sent = (m.nodes - 1) * m.chunk_bytes
    alpha = c.alpha_cross_s if m.nodes > 1 else c.alpha_intra_s
    return Transfer(compute_s=steps * alpha + sent / (c.intra_gbps * GBPS), link_s=t_cross)


def unit_costs(w: Workload, c: Cluster) -> list[UnitCosts]:
    """Per-unit costs of one micro-batch (root first; coalesced blocks are one unit,
    :meth:`Workload.coalesced`): ``compute_s`` split by :data:`FORWARD_SHARE`
    and by elements; each message of :func:`~experiments.projection.scaling.messages` under its unit and the
    phase the communication plan (``zeropp.runtime.plan``) issues it in (a message of ``count`` calls per step costs ``count / grad_accum`` per micro-batch, except the
    post-step ones and stages 0-1's reduction, which are per step); quantization per unit and
    phase from :func:`~experiments.projection.scaling.quant_time`."""
    w = w.coalesced()  # per unit the engine gathers: the plan's messages are numbered by these
    a = w.grad_accum
    total = sum(w.units)
    kept = w.kept_at_turn()
    by: dict[tuple[int, str], Transfer] = defaultdict(Transfer)
    for m in messages(w, c):
        phase = m.phase
        once = phase == Phase.POST or (phase == Phase.REDUCE and w.stage < 2)  # per step, not per micro-batch
        by[(m.unit, phase)] += message_transfer(m, c) * (m.count if once else m.count / a)
    out = []
    for i, n in enumerate(w.units):
        one = dataclasses.replace(w, units=(n,), keep_at_turn=False)  # (kept: below)
        q_all = quant_time(one, c)
        q_weights = quant_time(dataclasses.replace(one, grads=None), c)  # qwZ + qWD
        q_diff = quant_time(dataclasses.replace(one, grads=None, weights=None), c) if w.weight_diff else 0.0
        q_qwz, q_grads = q_weights - q_diff, q_all - q_weights
        fwd_q, bwd_q = (q_qwz / a, 0.0) if w.hpz else (q_qwz / (2 * a), q_qwz / (2 * a))
        if i in kept:  # still gathered from forward: no backward gather to dequantize
            bwd_q = 0.0
        red_q = q_grads / a if w.stage >= 2 else q_grads
        share = n / total
        out.append(
            UnitCosts(
                fwd_s=w.compute_s * FORWARD_SHARE * share / a,
                bwd_s=w.compute_s * (1 - FORWARD_SHARE) * share / a,
                fwd=by[(i, Phase.FWD)] + Transfer(fwd_q),
                bwd=by[(i, Phase.BWD)] + Transfer(bwd_q),
                reduce=by[(i, Phase.REDUCE)] + Transfer(red_q),
                post=by[(i, Phase.POST)] + Transfer(q_diff),
            )
        )
    return out


Tag = tuple[int, str, int]
"""(unit index, phase, micro-batch; -1: once per step) of a traced interval."""


@dataclasses.dataclass(frozen=True)
class Interval:
    """One traced piece of a scheduled step (:func:`scheduled_step_s` with ``trace``)."""

    lane: str
    """``compute`` (the unit's forward/backward), ``comm_compute`` (CPU ranks' collective work on the
    compute resource), ``quantization`` or ``link``."""
    start_s: float
    end_s: float
    tag: Tag


class _Timeline:
    """The two resources' clocks; :meth:`issue` returns when a transfer is done. With ``trace`` every
    nonzero interval is appended to it."""

    def __init__(self, trace: list[Interval] | None = None) -> None:
        self.compute = 0.0
        self.link = 0.0
        self.trace = trace

    def _note(self, lane: str, start: float, end: float, tag: Tag | None) -> None:
        if self.trace is not None and tag is not None and end > start:
            self.trace.append(Interval(lane, start, end, tag))

    def issue(self, t: Transfer, tag: Tag | None = None) -> float:
        self._note("quantization", self.compute, self.compute + t.quant_s, tag)
        self.compute += t.quant_s  # quantize first: the transfer sends its output
        start = self.compute
        self.compute += t.compute_s  # (CPU ranks) latency and copies, while the link moves the bytes
        self._note("comm_compute", start, self.compute, tag)
        link_end = max(self.link, start) + t.link_s if t.link_s else start
        self._note("link", link_end - t.link_s, link_end, tag)
        self.link = max(self.link, link_end)
        return max(self.compute, link_end)

    def wait(self, done: float) -> None:
        self.compute = max(self.compute, done)

    def run(self, seconds: float, tag: Tag | None = None) -> None:
        self._note("compute", self.compute, self.compute + seconds, tag)
        self.compute += seconds


def _gathered(
    tl: _Timeline,
    first: Transfer,
    blocks: list[tuple[Transfer, float]],
    prefetch: int,
    *,
    after_first: float,
    reduces: list[Transfer] | None = None,
    out: list[float] | None = None,
    tags: tuple[Tag, list[int]] | None = None,
) -> None:
    """One pass of stage 3 (forward, or backward with ``reduces``): the root's gather and wait,
    ``after_first`` seconds of the root's compute, then per block (gather, compute) in this
    order: wait its gather (issuing it now if no prefetch did), issue the next ``prefetch``
    blocks' gathers, compute, and issue its reduce-scatter (``reduces[k]``, done times to ``out``).
    ``tags``: the root's tag and the blocks' unit indices, for a traced timeline."""
    done: dict[int, float] = {}
    root_tag, units = tags if tags is not None else (None, [])

    def tag(k: int, phase: str | None = None) -> Tag | None:
        return None if root_tag is None else (units[k], phase or root_tag[1], root_tag[2])

    def issue(k: int) -> None:
        if k < len(blocks) and k not in done:
            done[k] = tl.issue(blocks[k][0], tag(k))

    tl.wait(tl.issue(first, root_tag))
    for k in range(max(prefetch, 0)):
        issue(k)
    tl.run(after_first, root_tag)
    for k, (_, seconds) in enumerate(blocks):
        issue(k)
        tl.wait(done[k])
        for j in range(k + 1, k + 1 + max(prefetch, 0)):
            issue(j)
        tl.run(seconds, tag(k))
        if reduces is not None and out is not None:
            out.append(tl.issue(reduces[k], tag(k, Phase.REDUCE)))


def scheduled_step_s(
    units: list[UnitCosts],
    *,
    stage: int,
    micro_batches: int = 1,
    prefetch: int = 1,
    control_s: float = 0.0,
    trace: list[Interval] | None = None,
) -> float:
    """Step time of ``units`` (root first, then the blocks in forward order) under the engine's
    issue order (module doc); ``prefetch``: stage 3's ``prefetch_depth``; ``control_s``: the
    uncounted scalar all-reduces, charged at the end; ``trace``: gets every interval of the step
    (:class:`Interval`, tagged with unit, phase and micro-batch), for a timeline."""
    if not units:
        raise ValueError("no units")
    root, blocks = units[0], units[1:]
    fwd_order, bwd_order = list(range(1, len(units))), list(range(len(units) - 1, 0, -1))
    tl = _Timeline(trace)
    for mb in range(micro_batches):
        last = mb == micro_batches - 1
        reduces: list[float] = []
        if stage == 3:  # gathers: wait for this block's, then issue the next ``prefetch`` blocks'
            _gathered(
                tl,
                root.fwd,
                [(b.fwd, b.fwd_s) for b in blocks],
                prefetch,
                after_first=0.0,
                tags=((0, Phase.FWD, mb), fwd_order),
            )
            tl.run(root.fwd_s, (0, Phase.FWD, mb))
            _gathered(
                tl,
                root.bwd,
                [(b.bwd, b.bwd_s) for b in reversed(blocks)],
                prefetch,
                after_first=root.bwd_s,
                reduces=[b.reduce for b in reversed(blocks)] if stage >= 2 else None,
                out=reduces,
                tags=((0, Phase.BWD, mb), bwd_order),
            )
        else:
            for i, u in [*zip(fwd_order, blocks), (0, root)]:
                tl.run(u.fwd_s, (i, Phase.FWD, mb))
            tl.run(root.bwd_s, (0, Phase.BWD, mb))
            for i, b in zip(bwd_order, reversed(blocks)):
                tl.run(b.bwd_s, (i, Phase.BWD, mb))
                if stage == 2:
                    reduces.append(tl.issue(b.reduce, (i, Phase.REDUCE, mb)))
        if stage >= 2:
            reduces.append(tl.issue(root.reduce, (0, Phase.REDUCE, mb)))
        elif last:  # stages 0-1: every unit once, after the last backward, in backward order
            reduces += [tl.issue(units[i].reduce, (i, Phase.REDUCE, -1)) for i in [*bwd_order, 0]]
        for d in reduces:
            tl.wait(d)
    for d in [tl.issue(u.post, (i, Phase.POST, -1)) for i, u in enumerate(units)]:
        tl.wait(d)
    tl.run(control_s, (-1, Phase.CONTROL, -1))
    return tl.compute


def project_scheduled(w: Workload, c: Cluster, *, prefetch: int = 1) -> Projection:
    """:func:`~experiments.projection.scaling.project` with the step time of :func:`scheduled_step_s` instead of
    the serial formula (``w.overlap`` is not used); ``comm_s`` is then the step's time beyond
    ``compute_s`` (what the ranks wait for, quantization included)."""
    msgs = messages(w, c)
    step = scheduled_step_s(
        unit_costs(w, c), stage=w.stage, micro_batches=w.grad_accum, prefetch=prefetch, control_s=control_time(w, c)
    )
    return Projection(
        c,
        step - w.compute_s,
        w.compute_s,
        step,
        w.tokens_per_rank * c.world / step,
        w.flops_per_token * w.tokens_per_rank / step / 1e12,
        node_cross_bytes(msgs, c),
        pairwise_bytes(msgs),
        uplink_bytes(msgs, c),
        quant_time(w, c),
    )


def main(argv: list[str] | None = None) -> None:
    """``python -m experiments.step_schedule``: ``python -m experiments.scaling``'s projection table
    (same options but ``--overlap``) with scheduled step times (prefetch depth 1, GPU streams)."""
    from .speedup import main as scaling_main

    scaling_main(argv, projector=project_scheduled, prog="python -m experiments.step_schedule")


def cli() -> NoReturn:
    """The command: :func:`main`, ended by ``launch.command.run_command`` (Ctrl-C or a failed world
    is one ``error:`` line and the shell's exit status, never a traceback)."""
    run_command(main)


if __name__ == "__main__":
    cli()
