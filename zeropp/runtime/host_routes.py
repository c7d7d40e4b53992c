"""The engine's plain collectives that never leave the host: a group of this rank alone
(:func:`copy_alone`) and the host's shared memory (``ZeroConfig.transport='shm'``, :class:`ShmRoute`).

Both are accounted as the backend calls they replace (one call per bucket-sized chunk), so the
byte accounting, the plan and a profiled step read the same through any route.

A :class:`ShmRoute` owns one group's :class:`~zeropp.comm.shm.ShmTransport` and issues the plain
(unquantized) all-gathers, reduce-scatters and all-reduces that :class:`~.collectives.EngineComm`
routes to it. Each is accounted as the backend call it replaces (one call per bucket-sized chunk,
the same bytes to the same peers), so the byte accounting, the plan and the scaling model read the
same through either transport; it is named in the profiler as one range, and averaged by the
engine's local divide, as the backend path is.
"""

from __future__ import annotations

import datetime
from typing import Callable, Literal, Optional, Protocol

import torch
import torch.distributed as dist

from zeropp.comm import callcheck, ranges
from zeropp.comm.kinds import CommKind
from zeropp.comm.session import CommSession
from zeropp.comm.shm import ShmTransport
from zeropp.comm.stats import CommStats, group_ranks, peer_bytes, record_sends
from zeropp.comm.topology import Topology

from .pending import Pending
from .plan_kinds import chunk_ranges
from .streams import CommStreams

ShmOpName = Literal["all_gather", "reduce_scatter", "all_reduce"]
"""The collectives a route carries (sums: the reductions are averaged by the caller's divide)."""


class RouteOwner(Protocol):
    """What a route reads from its engine's communication: where calls are counted and checked,
    and the streams its :class:`~.pending.Pending` waits through."""

    topology: Topology
    stats: CommStats
    session: CommSession
    streams: CommStreams


def copy_alone(
    owner: RouteOwner, dst: torch.Tensor, src: torch.Tensor, *, bucket: int, kind: CommKind, unit: str
) -> Pending:
    """A full-precision all-gather or reduce-scatter over a group of this rank alone (world 1, hpZ
    groups of one): its result is its input, so ``src`` is copied into ``dst`` at once, on the
    current stream (stream order makes it visible to what runs after, with no side stream or
    event), and the returned work is already finished. Each bucket-sized chunk is counted as the
    call it would have been, and named in the profiler when ranges are on (one copy per chunk
    then), so byte accounting, the plan and a profiled step read as with a backend.
    The backends' own local path (``zeropp.comm.backend``) gives the same bits, but a gather or
    reduction of a unit would still pass the public collective's checks, the chunk loop, a side
    stream and two events: host time that was most of stage 3's overhead over stage 0 at world 1."""
    d, s = dst.view(-1), src.reshape(-1)  # [n] each
    chunks = chunk_ranges(d.numel(), 1, bucket)
    for _ in chunks:
        owner.stats.count_call(kind)
    if ranges.enabled():
        for k, (a, b) in enumerate(chunks):
            with ranges.span(ranges.call_name(kind, unit, k)):
                d[a:b].copy_(s[a:b])
    else:
        d.copy_(s)
    return Pending.finished(owner, (kind, unit))


class ShmRoute:
    """``group``'s plain collectives through a region of shared memory (collective to construct, on
    every member of ``group``; ``timeout``: how long a wait for a live peer lasts)."""

    def __init__(self, owner: RouteOwner, group: Optional[dist.ProcessGroup], *, timeout: datetime.timedelta) -> None:
        self.owner = owner
        self.group = group
        self.ranks = group_ranks(group)
        self.world = len(self.ranks)
        self.transport = ShmTransport(group, timeout=timeout)
        """The group's region and its synchronisation (``zeropp.comm.shm``)."""

    def prepare(
        self, op: ShmOpName, dst: torch.Tensor, src: torch.Tensor, *, bucket: int, kind: CommKind, unit: str
    ) -> Callable[[], Pending]:
        """Check (in the collectives debug mode) and account one collective now; returns what issues
        it (for ``EngineComm.launch``). ``dst`` / ``src``: ``[W * S]`` / ``[S]`` (all-gather),
        ``[S]`` / ``[W * S]`` (reduce-scatter), the same ``[n]`` tensor (all-reduce, in place)."""
        owner, w, ranks = self.owner, self.world, self.ranks
        per_rank = src.numel() // w if op == "reduce_scatter" else src.numel()  # S (gather, scatter) or n
        # ZEROPP_DEBUG_COLLECTIVES=1: every rank's call compared first, as the backend path's (callcheck.py)
        with callcheck.agreed(owner.session.check_collectives, self.group, f"shm_{op}", ranks, per_rank) as fp:
            fp["dtype"] = callcheck.dtype_name(src.dtype)
        chunks = [(0, per_rank)] if op == "all_reduce" else chunk_ranges(per_rank, w, bucket)
        size = src.element_size()
        for a, b in chunks:
            owner.stats.count_call(kind)
            n = (b - a) * (w if op == "reduce_scatter" else 1)  # the elements this rank sends in that call
            record_sends(owner.stats, kind, owner.topology, ranks, peer_bytes(op, n * size, w))
        name = ranges.call_name(kind, unit, 0) if ranges.enabled() else None
        shm = self.transport

        def issue() -> Pending:
            with ranges.span(name):
                if op == "all_gather":
                    return Pending(owner, [shm.all_gather(dst, src)], None, what=(kind, unit))
                if op == "reduce_scatter":
                    return Pending(owner, [shm.reduce_scatter_sum(dst, src)], lambda: dst.div_(w), what=(kind, unit))
                return Pending(owner, [shm.all_reduce_sum(dst)], lambda: dst.div_(w), what=(kind, unit))

        return issue
