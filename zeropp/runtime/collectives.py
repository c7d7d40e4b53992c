"""The engine's only door to communication.

Everything the engine sends goes through :class:`EngineComm`, which

- owns the engine's communication session (``zeropp.comm.CommSession``: topology and groups,
  ``CommStats``, the stochastic-rounding counter, side streams of continuations, wait hooks),
  so two engines in one process share none of it,
- routes to ``zeropp.comm`` (quantized or plain, with byte accounting by link),
- splits a collective larger than the bucket size into column chunks (each rank's shard is
  cut at the same offsets, so chunk ``k`` of the full buffer is ``[G, c]`` columns of the
  ``[G, S]`` view and its reduce-scatter lands in ``shard[a:b]``); a quantized chunk reads and
  writes those columns in place (row-strided views), a plain one goes through a contiguous
  temporary because the backend collectives need one,
- issues asynchronous collectives on the side streams of :class:`~.streams.CommStreams` (CUDA)
  and times how long the engine is blocked waiting (``wait_s``: compute-stream stalls measured
  with events on CUDA, host time on CPU; see ``streams.py``), which the runner reports as
  exposed communication.

Buffer lifetimes (``zeropp.comm.lifetime``): a chunk's contiguous temporaries belong to its
:class:`~.pending.Pending` (``pending.py``); the handles release their own wire buffers.

The shared-memory transport (``ZeroConfig.transport='shm'``, or ``'auto'`` resolved to it) carries
the ZeRO group's plain collectives through :class:`~.host_routes.ShmRoute` (``host_routes.py``).

Profiler ranges (``zeropp.comm.ranges``): while a profiler records, chunk ``k`` of unit ``u``'s
collective of kind ``K`` is the range ``zeropp/K/u/bk`` (the plan's entry,
``zeropp.runtime.plan.CommPlan.range_name``; a quantized reduce-scatter's hops suffix it), and
waiting for the whole collective ``zeropp/K/u/wait``.

Averaging: a plain reduce-scatter or all-reduce is a backend SUM followed by a local divide (no
dependence on a backend's AVG; gloo's has had bugs). A quantized reduce-scatter averages itself:
it sums in fp32 and scales by 1/W *before* the single rounding into the compute dtype, whereas a
sum rounded to fp16 overflows once it passes 65504 even when the mean does not (and in bf16 it
would be rounded twice).
"""

from __future__ import annotations

import datetime
from typing import Callable, Optional

import torch
import torch.distributed as dist

from zeropp.comm import ranges
from zeropp.comm.backend import backend_all_gather, control_all_reduce
from zeropp.comm.codecs import codec_for
from zeropp.comm.kinds import CommKind
from zeropp.comm.lifetime import Buffers
from zeropp.comm.session import CommSession
from zeropp.comm.shm import ShmTransport
from zeropp.comm.shm_choice import TransportChoice
from zeropp.comm.spec import QuantSpec
from zeropp.comm.stats import CommStats, group_ranks, peer_bytes, record_sends
from zeropp.comm.topology import Topology

from .batch import CONTROL_RANGE
from .choices import DEFAULT_TRANSPORT, Transport
from .host_routes import ShmRoute, copy_alone, open_route
from .pending import Pending
from .plan_kinds import chunk_ranges, group_size_of
from .streams import CommStreams

__all__ = ["EngineComm", "Pending"]


class EngineComm:
    """Collectives for one engine over a :class:`Topology` (groups built collectively at init)."""

    def __init__(
        self,
        topology: Topology,
        stats: CommStats,
        device: torch.device | None = None,
        *,
        transport: str | Transport = DEFAULT_TRANSPORT,
        timeout: datetime.timedelta | None = None,
    ) -> None:
        from zeropp import comm as zcomm  # the public collectives (qwZ / qgZ / accounting)

        self._z = zcomm
        self.topology = topology
        self.stats = stats
        self.session = CommSession(topology, stats=stats)
        """This engine's communication state: every collective below passes it (``zeropp.comm.session``)."""
        self.groups = self.session.groups()
        # ZeRO's world is the data-parallel dimension: the whole default group unless tp > 1
        self.group: Optional[dist.ProcessGroup] = None if topology.tp == 1 else self.groups.dp
        """The group ZeRO shards over (None = the default group; ``groups.dp`` when ``topology.tp > 1``)."""
        me = dist.get_rank()
        self.world_size = topology.dp_size
        self.rank = topology.dp_index(me)
        self.hpz_size = topology.hpz_group_size // topology.tp
        self.hpz_rank = self.rank % self.hpz_size
        self.device = device if device is not None else torch.device("cpu")  # where scalars travel (NCCL: the GPU)
        if transport == "shm" and self.device.type != "cpu":
            raise ValueError(
                f"transport='shm' moves CPU tensors through the host's shared memory; the engine runs on "
                f"{self.device}, so use transport='backend' (NCCL has its own shared-memory paths)"
            )
        self.streams = CommStreams(self.device)
        """Side streams, events and blocked-time measurement (``streams.py``; no-ops on CPU)."""
        self._before_next: Optional[Callable[[], object]] = None  # see defer_until_next_collective
        route, choice = open_route(
            self,
            self.group,
            requested=Transport(transport),
            device=self.device,
            nodes=len({topology.node_of(r) for r in group_ranks(self.group)}),  # the ZeRO group's
            timeout=dist.default_pg_timeout if timeout is None else timeout,
            secondary=self.groups.hpz if self.hpz_size > 1 else None,  # hpZ's gathers: the same region
        )
        self.shm_route: Optional[ShmRoute] = route
        """The ZeRO group's plain collectives through shared memory (``ZeroConfig.transport``
        ``shm``, or ``auto`` resolved to it; None: the backend's)."""
        self.transport: TransportChoice = choice
        """What carries the plain collectives, as requested and as resolved, the same on every rank of
        the ZeRO group (``host_routes.open_route``)."""
        self.session.transport = choice

    def close(self) -> None:
        """Release what this engine's communication holds outside the process's objects: the ZeRO
        group's shared-memory region (local, no collective; safe to call twice). A collective after
        this through that region raises."""
        if self.shm_route is not None:
            self.shm_route.close()

    @property
    def shm(self) -> Optional[ShmTransport]:
        """The ZeRO group's shared-memory transport (None: the backend's)."""
        return None if self.shm_route is None else self.shm_route.transport

    def defer_until_next_collective(self, check: Callable[[], object]) -> None:
        """Run ``check`` before this engine's next collective, or at :meth:`run_deferred`,
        whichever comes first (a deferred forward check, ``batch.py``): what it raises is raised
        there, before anything is sent. A check already waiting runs first."""
        self.run_deferred()
        self._before_next = check

    def run_deferred(self) -> None:
        """Run the deferred check now, if one is waiting (see :meth:`defer_until_next_collective`)."""
        check, self._before_next = self._before_next, None
        if check is not None:
            with self.streams.blocked():
                check()

    @property
    def wait_s(self) -> float:
        """Seconds the engine was blocked on communication since :meth:`reset_wait` (``streams.py``
        says what is measured on CUDA and on CPU)."""
        return self.streams.blocked_s()

    def reset_wait(self) -> None:
        self.streams.reset()

    def hpz_share(self, gathered: torch.Tensor) -> torch.Tensor:
        """A copy of this rank's share of a world-gathered buffer (``[G * X]`` values or wire rows in
        member order): the ``1 / h`` slice hpZ keeps as this rank's secondary, ``h`` the hpZ group's
        size. Members ``k, k + h, ...`` of the hpZ group hold the other shares, so an all-gather over
        the hpZ group rebuilds the whole buffer."""
        return gathered.view(self.hpz_size, -1)[self.hpz_rank].clone()  # [G * X / h]

    def _group(self, hpz: bool) -> tuple[Optional[dist.ProcessGroup], int]:
        return (self.groups.hpz, self.hpz_size) if hpz else (self.group, self.world_size)

    # ------------------------------------------------------------------ spec -> zeropp.comm
    # ------------------------------------------------------------------ all-gather
    def all_gather(
        self,
        out: torch.Tensor,
        shard: torch.Tensor,
        *,
        spec: Optional[QuantSpec],
        hpz: bool = False,
        bucket: int,
        kind: CommKind,
        unit: str = "",
        async_op: bool,
        wire_out: Optional[torch.Tensor] = None,
    ) -> Pending:
        """Gather ``shard`` ([S]) of every member into ``out`` ([G * S], member order), quantized as
        ``spec`` says (None = full precision; each chunk is one call of the stochastic seed rule).
        ``unit``: the unit's name, for the profiler ranges (module doc; "": none). ``wire_out``
        (quantized, one chunk only: see :meth:`gathers_whole`): receives the gathered wire rows
        and keeps them (``zeropp.comm.quantized_all_gather``)."""
        group, g = self._group(hpz)
        s = shard.numel()
        if g == 1 and spec is None and wire_out is None:
            return self._alone(out, shard, bucket=bucket, kind=kind, unit=unit)
        route, within = self.shm_route, self.shm_route.secondary if hpz and self.shm_route is not None else None
        if route is not None and spec is None and wire_out is None and (within is not None or not hpz):
            through = route.prepare("all_gather", out, shard, bucket=bucket, kind=kind, unit=unit, within=within)
            return self.launch("all_gather", through, (shard,), async_op)
        if wire_out is not None and not self.gathers_whole(s, hpz=hpz, bucket=bucket):
            raise ValueError(
                f"EngineComm.all_gather: wire_out keeps one call's wire rows, but a shard of {s} elements is cut into "
                f"buckets of {bucket}; pass wire_out only when gathers_whole() is True"
            )

        def issue() -> Pending:
            works: list = []
            finishes: list[Callable[[], object]] = []
            temps = Buffers()
            named = ranges.enabled()
            for k, (a, b) in enumerate(chunk_ranges(s, g, bucket)):
                whole = (a, b) == (0, s)
                if whole:
                    dst = out
                elif spec is not None and codec_for(spec).in_place:  # dequantized straight into out's columns
                    dst = out.view(g, s)[:, a:b]  # [g, b - a] row-strided view
                else:  # the backend all-gather needs a contiguous output
                    dst = torch.empty(g * (b - a), dtype=out.dtype, device=out.device)
                    temps.add(dst)

                    def copy_back(dst: torch.Tensor = dst, a: int = a, b: int = b) -> None:
                        out.view(g, s)[:, a:b].copy_(dst.view(g, b - a))

                    finishes.append(copy_back)
                works.append(
                    self._z.quantized_all_gather(
                        dst,
                        shard[a:b],
                        group,
                        kind=kind,
                        async_op=True,
                        spec=spec,
                        session=self.session,
                        name=ranges.call_name(kind, unit, k) if named else None,
                        **({} if wire_out is None else {"wire_out": wire_out}),
                    )
                )
            return Pending(
                self, works, (lambda: [f() for f in finishes]) if finishes else None, buffers=temps, what=(kind, unit)
            )

        return self.launch("all_gather", issue, (shard,), async_op)

    def gathers_whole(self, s: int, *, hpz: bool = False, bucket: int) -> bool:
        """Whether :meth:`all_gather` sends a shard of ``s`` elements as one call (not cut into buckets)."""
        return len(chunk_ranges(s, self._group(hpz)[1], bucket)) == 1

    def all_gather_rows(
        self,
        out: torch.Tensor,
        rows: torch.Tensor,
        *,
        spec: QuantSpec,
        hpz: bool,
        kind: CommKind,
        unit: str = "",
        async_op: bool,
        on_rows: Optional[Callable[[torch.Tensor], object]] = None,
    ) -> Pending:
        """All-gather wire rows as they are and dequantize them into ``out`` ([W * S], any float
        dtype; ``S`` from ``out``): ``rows`` (uint8, this member's ``W / G * B`` bytes, ``G`` the
        group's size) over the hpZ group (``hpz``) or the world. Nothing is re-quantized, so ``out``
        is bit for bit what dequantizing the same rows anywhere gives. ``on_rows(recv)`` sees the
        gathered ``[W * B]`` rows before they are dequantized. One call, never cut into buckets."""
        group, g = self._group(hpz)
        W = self.world_size
        S, B = out.numel() // W, rows.numel() * g // W
        if rows.dtype != torch.uint8 or rows.numel() * g != W * B or out.numel() != W * S:
            raise ValueError(
                f"EngineComm.all_gather_rows: rows must be uint8 holding {W // g} wire rows per member and out "
                f"{W} x S elements; got {rows.dtype} {rows.numel()} bytes and out of {out.numel()}"
            )
        codec = codec_for(spec)
        gs = group_size_of(spec, weights=True)  # as quantized_all_gather
        name = ranges.call_name(kind, unit, 0) if ranges.enabled() else None

        def issue() -> Pending:
            self.stats.count_call(kind)
            recv = torch.empty(W * B, dtype=torch.uint8, device=out.device)  # [W * B]: rows in rank order
            record_sends(self.stats, kind, self.topology, group_ranks(group), peer_bytes("all_gather", rows.numel(), g))
            with ranges.span(name):
                work = backend_all_gather(recv, rows, group, True)

            def finish() -> None:  # [W, B] rows -> [W, S] values, read through views of recv
                if on_rows is not None:
                    on_rows(recv)
                with ranges.span(name, "dequantize"):
                    codec.dequantize(codec.unpack(recv.view(W, B), S, spec.bits, gs), out=out.view(W, S))

            return Pending(self, [work], finish, what=(kind, unit))

        return self.launch("all_gather", issue, (rows,), async_op)

    # ------------------------------------------------------------------ reduce-scatter
    def reduce_scatter(
        self,
        out: torch.Tensor,
        full: torch.Tensor,
        *,
        spec: Optional[QuantSpec],
        error_feedback: object = None,
        key: str = "",
        bucket: int,
        kind: CommKind,
        unit: str = "",
        async_op: bool,
    ) -> Pending:
        """Average ``full`` ([W * S]) over the world; this rank's chunk goes to ``out`` ([S]),
        quantized as ``spec`` says (None = full precision). ``error_feedback`` (a
        ``zeropp.comm.ErrorFeedback``, when ``spec.error_feedback``) keeps residuals under ``key``.
        ``unit``: the unit's name, for the profiler ranges (module doc; "": none)."""
        w = self.world_size
        s = out.numel()
        quantized = spec is not None
        if w == 1 and not quantized:  # the sum over one rank is its input, and x / 1 == x: a copy
            return self._alone(out, full, bucket=bucket, kind=kind, unit=unit)
        if self.shm_route is not None and not quantized:
            through = self.shm_route.prepare("reduce_scatter", out, full, bucket=bucket, kind=kind, unit=unit)
            return self.launch("reduce_scatter", through, (full,), async_op)
        op = dist.ReduceOp.AVG if quantized else dist.ReduceOp.SUM  # see the module docstring

        def issue() -> Pending:
            works: list = []
            temps = Buffers()
            named = ranges.enabled()
            for k, (a, b) in enumerate(chunk_ranges(s, w, bucket)):
                if (a, b) == (0, s):
                    src = full
                elif spec is not None and codec_for(spec).in_place:  # [w, b - a] view, quantized in place (no copy)
                    src = full.view(w, s)[:, a:b]
                else:  # the backend reduce-scatter needs a contiguous input
                    src = full.view(w, s)[:, a:b].contiguous()
                    temps.add(src)
                extra = dict(error_feedback=error_feedback, feedback_key=f"{key}:{a}") if quantized else {}
                works.append(
                    self._z.quantized_reduce_scatter(
                        out[a:b],
                        src,
                        op,
                        self.group,
                        spec=spec,
                        kind=kind,
                        async_op=True,
                        session=self.session,
                        name=ranges.call_name(kind, unit, k) if named else None,
                        **extra,
                    )
                )
            return Pending(self, works, None if quantized else (lambda: out.div_(w)), buffers=temps, what=(kind, unit))

        return self.launch("reduce_scatter", issue, (full,), async_op)

    def _alone(self, dst: torch.Tensor, src: torch.Tensor, *, bucket: int, kind: CommKind, unit: str) -> Pending:
        """A full-precision collective over a group of this rank alone: a copy at issue (``host_routes.py``)."""
        self.run_deferred()
        return copy_alone(self, dst, src, bucket=bucket, kind=kind, unit=unit)

    def launch(
        self, kind: str, issue: Callable[[], Pending], reads: tuple[torch.Tensor, ...], async_op: bool
    ) -> Pending:
        """Issue a collective: asynchronously on the ``kind`` side stream when there are streams
        (finished there at once, an event marks its end), else on the current stream/thread;
        synchronous calls are waited before returning. See ``streams.py`` for what is timed."""
        self.run_deferred()
        st = self.streams
        if async_op and st.enabled:
            with st.issuing(kind, reads):
                issue().complete()  # enqueued on the side stream: under NCCL the host does not wait
                ev = st.record(kind)
            return Pending(self, [], None, event=ev)
        with st.blocked():  # CPU: issuing a quantized collective quantizes on this thread
            p = issue()
            if not async_op:
                p.complete()
                p.done = True
        return p

    # ------------------------------------------------------------------ all-reduce / misc
    def all_reduce_mean(self, t: torch.Tensor, *, kind: CommKind, unit: str = "", async_op: bool = False) -> Pending:
        """In-place average over the world (stage 0 gradients, replicated units); ``unit``: the
        unit's name, for the profiler range (module doc). ``async_op``: return at once (on CUDA
        on the gradient side stream); ``t`` holds the mean after the returned :class:`Pending`'s
        ``wait``, so several units' all-reduces can be in flight at once."""
        w = self.world_size
        if self.shm_route is not None:  # (built for a group of two or more only)
            through = self.shm_route.prepare("all_reduce", t, t, bucket=t.numel(), kind=kind, unit=unit)
            return self.launch("reduce_scatter", through, (t,), async_op)  # (a gradient reduction: that side stream)

        def issue() -> Pending:
            work = self._z.all_reduce(
                t,
                dist.ReduceOp.SUM,
                self.group,
                kind=kind,
                async_op=True,
                session=self.session,
                name=ranges.call_name(kind, unit, 0) if ranges.enabled() else None,
            )
            return Pending(self, [work], lambda: t.div_(w), what=(kind, unit))

        return self.launch("reduce_scatter", issue, (t,), async_op)  # (a gradient reduction: that side stream)

    def sum_scalars(self, values: list[float]) -> list[float]:
        """Sum a few fp64 scalars over the whole default group, tensor-parallel ranks included (loss,
        squared norms). Control traffic: a few bytes per step, deliberately not accounted so the
        byte formulas stay exact."""
        self.run_deferred()
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        with self.streams.blocked(), ranges.span(CONTROL_RANGE):
            control_all_reduce(t, "sum")
        return t.tolist()

    def broadcast_(self, t: torch.Tensor, src: int = 0) -> None:
        """Initial synchronisation of weights (once, at wrap time; not accounted) from data-parallel
        rank ``src`` (with ``tp > 1`` each tensor-parallel rank broadcasts its own part). ``t`` must
        be on the engine's device (NCCL cannot broadcast a CPU tensor)."""
        self._check_device(t, "broadcast")
        self.run_deferred()
        if self.group is None:
            dist.broadcast(t, src)
        else:
            dist.broadcast(t, dist.get_global_rank(self.group, src), group=self.group)

    def _check_device(self, t: torch.Tensor, what: str) -> None:
        if t.device.type != self.device.type:
            raise ValueError(
                f"EngineComm.{what}: tensor on {t.device}, but the engine communicates on "
                f"{self.device}; move it to {self.device} first"
            )
