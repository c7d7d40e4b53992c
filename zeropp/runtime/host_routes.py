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

:func:`open_route` resolves ``ZeroConfig.transport`` into a route once, at set-up: ``auto`` (the
default) takes the shared memory wherever every rank of the ZeRO group can use it and the backend
otherwise, the same on every rank (``zeropp.comm.shm_auto``), and records why.
"""

from __future__ import annotations

import dataclasses
import datetime
import weakref
from typing import Callable, Literal, Optional, Protocol

import torch
import torch.distributed as dist

from zeropp.comm import callcheck, ranges
from zeropp.comm.backend import control_all_reduce
from zeropp.comm.kinds import CommKind
from zeropp.comm.plain import sum_reduce_scatter_call
from zeropp.comm.session import CommSession
from zeropp.comm.shm import ShmOp, ShmTransport
from zeropp.comm.shm_auto import shm_ability
from zeropp.comm.shm_choice import TransportChoice
from zeropp.comm.shm_sync import ShmError
from zeropp.comm.stats import CommStats, group_ranks, peer_bytes, record_sends
from zeropp.comm.topology import Topology

from .choices import Transport
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

    def run_deferred(self) -> None:
        """Run the engine's deferred check (it raises before anything is counted or sent)."""


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class SubGroup:
    """A group inside a route's group whose gathers the route carries (hpZ's secondary group: every
    ZeRO rank gathers the same unit at the same point, each inside its own secondary group)."""

    group: Optional[dist.ProcessGroup]
    ranks: list[int]
    """Its global ranks, in group order (what the call is accounted and checked over)."""
    members: range
    """Their indices in the route's group (consecutive)."""


class ShmRoute:
    """``group``'s plain collectives through a region of shared memory (collective to construct, on
    every member of ``group``; ``timeout``: how long a wait for a live peer lasts). ``secondary``:
    hpZ's secondary group of this rank, whose gathers the same region carries when its members are
    consecutive members of ``group`` (as ``Topology.build`` makes them)."""

    def __init__(
        self,
        owner: RouteOwner,
        group: Optional[dist.ProcessGroup],
        *,
        timeout: datetime.timedelta,
        secondary: Optional[dist.ProcessGroup] = None,
    ) -> None:
        self._owner = weakref.ref(owner)  # the owner holds the route: no cycle keeps the region mapped
        self.group = group
        self.ranks = group_ranks(group)
        self.world = len(self.ranks)
        self.transport = ShmTransport(group, timeout=timeout)
        """The group's region and its synchronisation (``zeropp.comm.shm``)."""
        own = None if secondary is None else self.sub_group(secondary)
        # Each member judges its own secondary group; the region carries those gathers only if it
        # carries every member's, else a member writing its row would wait for ever on members that
        # gather through the backend. One exchange makes the choice the group's.
        refused = torch.tensor([0 if own is not None else 1], dtype=torch.int64)
        control_all_reduce(refused, "max", group)
        self.secondary = own if int(refused) == 0 else None
        """hpZ's secondary group as a :class:`SubGroup` (None: none, or its gathers keep the backend,
        on every member alike)."""

    @property
    def owner(self) -> RouteOwner:
        """The engine communication this route counts and checks through (held weakly)."""
        owner = self._owner()
        if owner is None:
            raise RuntimeError("ShmRoute: its engine's communication is gone; the route cannot be used")
        return owner

    def close(self) -> None:
        """Unmap the group's region now (local; safe to call twice; ``ShmTransport.close``)."""
        self.transport.close()

    def sub_group(self, group: Optional[dist.ProcessGroup]) -> Optional[SubGroup]:
        """``group`` as a :class:`SubGroup` whose gathers this route carries; None unless its members
        are consecutive members of this route's group."""
        ranks = group_ranks(group)
        if not set(ranks) <= set(self.ranks):
            return None
        first = self.ranks.index(ranks[0])
        if self.ranks[first : first + len(ranks)] != ranks:
            return None
        return SubGroup(group=group, ranks=ranks, members=range(first, first + len(ranks)))

    def prepare(
        self,
        op: ShmOpName,
        dst: torch.Tensor,
        src: torch.Tensor,
        *,
        bucket: int,
        kind: CommKind,
        unit: str,
        within: Optional[SubGroup] = None,
    ) -> Callable[[], Pending]:
        """Run the owner's deferred check, check (in the collectives debug mode) and account one
        collective now; returns what issues it (for ``EngineComm.launch``). ``dst`` / ``src``: ``[W * S]`` / ``[S]`` (all-gather),
        ``[S]`` / ``[W * S]`` (reduce-scatter), the same ``[n]`` tensor (all-reduce, in place).
        ``within`` (all-gather only): gather inside that sub-group (``[G * S]`` / ``[S]``), accounted
        and checked as the backend's gather over it."""
        if within is not None and op != "all_gather":
            raise ValueError(f"ShmRoute.prepare: a sub-group carries all-gathers only, not {op}")
        owner = self.owner
        owner.run_deferred()  # a deferred forward check raises before anything is counted or sent
        group, ranks = (self.group, self.ranks) if within is None else (within.group, within.ranks)
        w = len(ranks)
        per_rank = src.numel() // w if op == "reduce_scatter" else src.numel()  # S (gather, scatter) or n
        # ZEROPP_DEBUG_COLLECTIVES=1: every rank's call compared first, as the backend path's (callcheck.py)
        with callcheck.agreed(owner.session.check_collectives, group, f"shm_{op}", ranks, per_rank) as fp:
            fp["dtype"] = callcheck.dtype_name(src.dtype)
        chunks = [(0, per_rank)] if op == "all_reduce" else chunk_ranges(per_rank, w, bucket)
        size = src.element_size()
        session = owner.session
        # the torch.distributed call the backend path makes (gloo reduce-scatters by an all-to-all)
        call = sum_reduce_scatter_call(group) if op == "reduce_scatter" else op
        for a, b in chunks:
            owner.stats.count_call(kind)
            n = (b - a) * (w if op == "reduce_scatter" else 1)  # the elements this rank sends in that call
            per_peer = peer_bytes(op, n * size, w)
            record_sends(owner.stats, kind, owner.topology, ranks, per_peer)
            session.sent(call, ranks, per_peer)  # what an outside count of torch.distributed would have seen
        name = ranges.call_name(kind, unit, 0) if ranges.enabled() else None
        shm = self.transport

        def issue() -> Pending:
            # issuing and waiting count as time blocked on communication, as a backend call and its
            # Work.wait do (the session's wait hooks)
            with ranges.span(name), session.waiting(op):
                if op == "all_gather":
                    members = None if within is None else within.members
                    started = shm.all_gather(dst, src, members)
                    finish: Optional[Callable[[], object]] = None
                elif op == "reduce_scatter":
                    started, finish = shm.reduce_scatter_sum(dst, src), lambda: dst.div_(w)
                else:
                    started, finish = shm.all_reduce_sum(dst), lambda: dst.div_(w)
            return Pending(owner, [_SessionWait(started, session, op)], finish, what=(kind, unit))

        return issue


class _SessionWait:
    """A shared-memory collective's wait, run inside its session's wait hooks (so an outside
    measure of time blocked on communication sees it, as it sees a backend ``Work.wait``)."""

    def __init__(self, op: ShmOp, session: CommSession, kind: str) -> None:
        self._op, self._session, self._kind = op, session, kind

    def wait(self) -> None:
        if self._op.done:
            return
        with self._session.waiting(self._kind):
            self._op.wait()


def _explicit_shm(
    owner: RouteOwner,
    group: Optional[dist.ProcessGroup],
    world: int,
    *,
    timeout: datetime.timedelta,
    secondary: Optional[dist.ProcessGroup],
) -> Optional[ShmRoute]:
    """``transport='shm'``: ``group``'s route (None for a group of one), whose set-up error raises.
    A region's set-up agrees within its own group only; with tensor parallelism the run has several
    ZeRO groups, and a group whose region failed would stop while the others trained on into their
    next tensor-parallel collective with its ranks and waited there until the timeout. So, where the
    run holds more than this group, one control all-reduce over the run tells every rank whether
    any group failed, and every rank raises."""
    route, error = None, None
    try:
        route = ShmRoute(owner, group, timeout=timeout, secondary=secondary) if world > 1 else None
    except ShmError as exc:
        error = exc
    if dist.get_world_size() > world:  # the same on every rank: ZeRO groups are all of one size
        failed = torch.zeros(dist.get_world_size(), dtype=torch.int64)
        failed[dist.get_rank()] = int(error is not None)
        control_all_reduce(failed, "sum", None)
        ranks = [r for r, f in enumerate(failed.tolist()) if f]
        if ranks and error is None:
            if route is not None:
                route.close()
            raise ShmError(
                f"transport='shm': the shared-memory region of another ZeRO group (ranks {ranks}) could not be "
                f"set up, so no group starts (their error says why); free room under /dev/shm or use "
                f"transport='backend' (or 'auto', which falls back to it)",
                cause=f"ranks {ranks} could not set up their ZeRO group's region",
            )
    if error is not None:
        raise error
    return route


def open_route(
    owner: RouteOwner,
    group: Optional[dist.ProcessGroup],
    *,
    requested: Transport,
    device: torch.device,
    nodes: int,
    timeout: datetime.timedelta,
    secondary: Optional[dist.ProcessGroup] = None,
) -> tuple[Optional[ShmRoute], TransportChoice]:
    """Collective over the default group (every rank of the run calls it at the same point): the route
    of ``group``'s plain collectives as ``requested``
    (``ZeroConfig.transport``) and what was chosen. ``shm``: a :class:`ShmRoute` (None for a group
    of one), whose set-up errors raise; ``backend``: None. ``auto``: a :class:`ShmRoute` when every
    member can use one (``zeropp.comm.shm_auto.shm_ability``: CPU ranks of a group on one node,
    ``nodes``: those ``group`` spans, room under ``/dev/shm``) and its region sets up, else None;
    decided over the whole run (every ZeRO group resolves alike: one transport per run), with the
    reason recorded."""
    choice = Transport(requested)
    world = len(group_ranks(group))
    if choice is Transport.backend:
        return None, TransportChoice(requested="backend", resolved="backend", reason="")
    if choice is Transport.shm:
        return _explicit_shm(owner, group, world, timeout=timeout, secondary=secondary), TransportChoice(
            requested="shm", resolved="shm", reason=""
        )
    if world < 2:
        return None, TransportChoice(requested="auto", resolved="backend", reason="one rank: nothing to exchange")
    # Asked of the whole run, not the ZeRO group alone: with tensor parallelism several ZeRO groups
    # share the host's room, and a group that agreed within itself could still differ from another.
    regions = dist.get_world_size() // world  # every ZeRO group makes one (all on this host when able)
    ability = shm_ability(None, device=device, nodes=nodes, regions=regions)
    if not ability.able:
        return None, TransportChoice(requested="auto", resolved="backend", reason=ability.reason)
    route, reason = None, ""
    try:
        route = ShmRoute(owner, group, timeout=timeout, secondary=secondary)
    except ShmError as exc:  # raised on every member alike (the region's set-up agrees on failure)
        reason = f"the shared-memory region could not be set up: {exc.cause}"
    failed = torch.tensor([0 if route is not None else 1], dtype=torch.int64)
    control_all_reduce(failed, "max", None)  # one transport for the run: any group's failure is every group's
    if int(failed):
        if route is not None:
            route.close()
        reason = reason or "the shared-memory region of another ZeRO group could not be set up"
        return None, TransportChoice(requested="auto", resolved="backend", reason=reason)
    return route, TransportChoice(requested="auto", resolved="shm", reason=ability.reason)
