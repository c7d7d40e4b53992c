"""Measure communication from outside any trainer: bytes per link class and time blocked on it.

Every trainer (zeropp's engine, FSDP2, DDP, plug-ins) ends up in ``torch.distributed``'s
collectives. :class:`CommWatch` wraps those functions and ``Work.wait`` in this process (torch
offers no hook on its own collectives' calls and waits; the stock FSDP2 / DDP trainers issue theirs
there), and records, per collective kind and link class (``intra`` / ``cross`` node, from the run's topology),
into a ``zeropp.comm.CommStats`` through ``zeropp.comm.stats.record_sends`` (zeropp owns the
accounting convention and the node classification; this module only reads the message sizes
off the ``torch.distributed`` call's arguments):

* **bytes** this rank sends, counted with the direct pairwise algorithm (all-gather: my shard to
  every peer; reduce-scatter: each peer's chunk to it; all-to-all: each split; all-reduce: 2/g
  of the buffer to each peer), zeropp.comm.stats' convention. These are *wire* bytes of whatever
  dtype travels (INT8 codes and scales for a quantized collective), so trainers are compared on
  equal terms; zeropp's own ``CommStats`` adds semantic kinds (forward vs backward all-gather)
  where a trainer has it.
* **wait seconds**: wall time the training thread spends inside a blocking collective or a
  ``Work.wait()``. That is the time communication is *not* overlapped with compute. A wait on a
  zeropp handle (a qgZ continuation's cross-node hop and the local dequantize included) is timed
  through the wait hook of the trainer's ``zeropp.comm.CommSession`` (``sessions=``), not by
  patching zeropp's classes; the backend waits nested in it count once, as part of it.
* **past torch.distributed**: a collective a session carries itself (the zeropp engine's
  shared-memory route, ``ZeroConfig.transport``) is told to the session's send hook and counted
  here as the backend call it replaces, and its issue and wait through the wait hook, so a run's
  ``comm_bytes`` and wait read the same whichever transport carried the data.

Nested calls (a collective implemented with another) are counted once, at the outermost call.
Counting never breaks a collective: one whose bytes cannot be read off its arguments still runs,
and the first such call of each op is named in a warning (``CommWatch.uncounted``).

**Functional collectives** (``torch.distributed._functional_collectives``, the
``torch.ops._c10d_functional`` ops that DTensor redistributions and therefore tensor parallelism
issue) do not pass through those Python functions: they go from the op straight to the backend
in C++. They are counted, under the same kinds and links, by a ``TorchDispatchMode`` that sees
every op dispatched on the training thread (and in the autograd work it starts); the time spent
in them and in ``wait_tensor`` counts as wait. A dispatch mode costs some microseconds per tensor
op (about 10 us on a CPU, which would distort the step times trainers are compared by), so it is
on when the topology has ``tp > 1`` (``functional=None``) or when asked for (``functional=True``).
Without it functional collectives are not counted; with ``tp == 1`` that leaves out only FSDP2's
gradient-norm all-reduce (``clip_grad_norm_`` on DTensor gradients, a few bytes per step): the
zeropp engine, DDP and the rest of FSDP2 call ``torch.distributed``.

What a call sends is read off its arguments in ``comm_sizes.py``; here the wrapping, the waits
and the dispatch mode.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import warnings
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.utils._python_dispatch import TorchDispatchMode

from zeropp.comm import CommSession, CommStats, Topology
from zeropp.comm.stats import record_sends

from .comm_sizes import FUNCTIONAL_OPS, WRAPPED, call_peer_bytes, functional_rule, op_kind


class CommWatch:
    """Patch torch.distributed for this process while active (see module doc).

    ``topology`` (zeropp.comm.Topology) classifies each peer as intra- or cross-node.
    ``functional``: count functional collectives too (module doc); ``None`` = when ``topology.tp > 1``.
    ``sessions``: the zeropp communication sessions (``zeropp.comm.CommSession``: the engine's, a
    plug-in's) whose handle waits count as wait, through their wait hooks, while active.
    Use as a context manager, entered and left on the training thread; ``take()`` returns and
    resets the counters (one step's worth); ``stats`` is the underlying CommStats.
    """

    def __init__(
        self,
        topology: Topology,
        functional: bool | None = None,
        sessions: tuple[CommSession, ...] | list[CommSession] = (),
    ) -> None:
        self.topology = topology
        self.functional = topology.tp > 1 if functional is None else bool(functional)
        self.sessions = [s for s in sessions if s is not None]
        for s in self.sessions:
            if not isinstance(s, CommSession):
                raise TypeError(f"CommWatch sessions must be zeropp.comm.CommSession objects, got {type(s).__name__}")
        self._hooks: list[Any] = []
        self._mode: _FunctionalCollectives | None = None
        self.stats = CommStats()
        self.wait_s = 0.0
        self._local = threading.local()
        self.training_thread = threading.get_ident()  # only this thread's blocking counts as wait (set on entry)
        self._lock = threading.Lock()  # zeropp's comm worker thread issues collectives too
        self._saved: list[tuple[Any, str, Any]] = []
        self.uncounted: dict[str, str] = {}
        """Collectives whose bytes could not be counted (op name -> the error), each warned about once."""

    # -- bookkeeping ---------------------------------------------------------------------
    def _account(self, name: str, args: tuple, kwargs: dict) -> None:
        group = kwargs.get("group")
        if group is None:
            idx = {
                "all_gather_into_tensor": 2,
                "all_gather_single": 2,
                "_all_gather_base": 2,
                "all_gather": 2,
                "reduce_scatter_tensor": 3,
                "reduce_scatter_single": 3,
                "_reduce_scatter_base": 3,
                "reduce_scatter": 3,
                "all_reduce": 2,
                "all_to_all_single": 4,
                "all_to_all": 2,
                "broadcast": 2,
                "reduce": 3,
                "gather": 3,
                "scatter": 3,
            }[name]
            group = args[idx] if len(args) > idx and not isinstance(args[idx], (bool, int)) else None
        try:
            ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        except Exception:
            ranks = list(range(dist.get_world_size()))
        me_global = dist.get_rank()
        if me_global not in ranks:
            return
        kind = op_kind(name)
        record_sends(
            self.stats, kind, self.topology, ranks, call_peer_bytes(name, args, kwargs, ranks, ranks.index(me_global))
        )
        self.stats.count_call(kind)

    def uncounted_call(self, name: str, exc: BaseException) -> None:
        """A collective ``name`` whose accounting raised ``exc``: the collective still runs (counting
        never breaks it), but the run's byte figures miss it, so the first time per op says so."""
        if name in self.uncounted:
            return
        self.uncounted[name] = f"{type(exc).__name__}: {exc}"
        warnings.warn(
            f"CommWatch could not count {name} ({self.uncounted[name]}): the collective runs, but this "
            "run's comm_bytes figures miss its bytes",
            RuntimeWarning,
            stacklevel=3,
        )

    def account_functional(self, kind: str, group: Any, per_peer: Callable[[int, int], list[int]]) -> None:
        """One functional collective over ``group`` (a ProcessGroup or its name): ``per_peer(group
        size, my group rank)`` gives the bytes to each member."""
        pg = (
            group
            if isinstance(group, dist.ProcessGroup)
            else torch.distributed.distributed_c10d._resolve_process_group(group)
        )
        ranks = dist.get_process_group_ranks(pg)
        me = dist.get_rank()
        if me not in ranks:
            return
        with self._lock:
            record_sends(self.stats, kind, self.topology, ranks, per_peer(len(ranks), ranks.index(me)))
            self.stats.count_call(kind)

    def account_sent(self, kind: str, ranks: list[int], per_peer: list[int]) -> None:
        """One collective a session carried past ``torch.distributed`` (``CommSession.add_send_hook``:
        the engine's shared-memory route), counted as the backend call it replaces would be."""
        if dist.get_rank() not in ranks:
            return
        with self._lock:
            record_sends(self.stats, kind, self.topology, ranks, per_peer)
            self.stats.count_call(kind)

    def _wrap(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._local, "depth", 0):
                return fn(*args, **kwargs)
            self._local.depth = 1
            t0 = time.perf_counter()
            try:
                try:
                    with self._lock:
                        self._account(name, args, kwargs)
                except Exception as e:
                    self.uncounted_call(name, e)
                return fn(*args, **kwargs)
            finally:
                if threading.get_ident() == self.training_thread:  # only the training thread's blocking counts
                    self.wait_s += time.perf_counter() - t0
                self._local.depth = 0

        return wrapper

    @contextlib.contextmanager
    def timing_wait(self, kind: str = "") -> Iterator[None]:
        """Count what runs inside as wait, when on the training thread and not nested in another
        counted wait or collective (a session's wait hook, and ``Work.wait``'s wrapper)."""
        if getattr(self._local, "depth", 0) or threading.get_ident() != self.training_thread:
            yield
            return
        self._local.depth = 1
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.wait_s += time.perf_counter() - t0
            self._local.depth = 0

    def _wrap_wait(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            with self.timing_wait():
                return fn(work, *args, **kwargs)

        return wait

    # -- lifecycle -----------------------------------------------------------------------
    def __enter__(self) -> CommWatch:
        self.training_thread = threading.get_ident()  # only this thread's blocking counts as wait (set on entry)
        wrappers: dict[str, Callable] = {}
        for name in WRAPPED:
            fn = getattr(c10d, name, None)
            if fn is None:
                continue
            wrappers[name] = self._wrap(name, fn)
            for mod in (dist, c10d):
                if getattr(mod, name, None) is fn:
                    self._saved.append((mod, name, fn))
                    setattr(mod, name, wrappers[name])
        work = getattr(torch._C._distributed_c10d, "Work", None)
        if work is not None:
            self._saved.append((work, "wait", work.wait))
            work.wait = self._wrap_wait(work.wait)
        # a zeropp handle's wait (qgZ's cross-node hop on the comm worker included): the sessions' hook
        self._hooks = [s.add_wait_hook(self.timing_wait) for s in self.sessions]
        # a call a session carries past torch.distributed (the engine's shared memory): counted alike
        self._hooks += [s.add_send_hook(self.account_sent) for s in self.sessions]
        if self.functional:
            self._mode = _FunctionalCollectives(self)
            self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)
        for obj, name, fn in reversed(self._saved):
            setattr(obj, name, fn)
        self._saved.clear()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def take(self) -> tuple[dict[str, int], float]:
        """``({"<kind>.<link>": bytes}, wait_seconds)`` since the last call; resets both."""
        with self._lock:
            b = {f"{k}.{ln}": v for k, links in self.stats.snapshot().items() for ln, v in links.items() if v}
            w = self.wait_s
            self.stats.reset()
            self.wait_s = 0.0
        return b, w


class _FunctionalCollectives(TorchDispatchMode):
    """The dispatch mode of :class:`CommWatch` (module doc). Hand-written because torch's
    ``CommDebugMode`` counts calls per op but gives neither the bytes nor the group; like it,
    this mode lets DTensor run first (``NotImplemented``), so it sees the collectives DTensor
    desugars into rather than the DTensor op."""

    supports_higher_order_operators = True  # passed through (DTensor's RNG wrapper is one)

    def __init__(self, watch: CommWatch) -> None:
        super().__init__()
        from torch.distributed.tensor import DTensor

        self.watch, self._dtensor = watch, DTensor
        self._ops: dict[Any, tuple[str, int]] = {}  # op packet -> (name, index of group_name in its schema)
        for ns, names in FUNCTIONAL_OPS.items():
            for name in names:
                packet = getattr(getattr(torch.ops, ns), name, None)
                if packet is not None:
                    args = torch._C._get_schema(f"{ns}::{name}", "").arguments
                    self._ops[packet] = (name, next(i for i, a in enumerate(args) if a.name == "group_name"))
        self._wait = torch.ops._c10d_functional.wait_tensor

    def __torch_dispatch__(self, func: Any, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(issubclass(t, self._dtensor) for t in types):
            return NotImplemented
        packet = func.overloadpacket
        known = self._ops.get(packet)
        if known is None and packet is not self._wait:
            return func(*args, **kwargs)
        if known is not None:
            name, gi = known
            try:
                kind, per_peer = functional_rule(name, args, kwargs)
                self.watch.account_functional(kind, args[gi] if len(args) > gi else kwargs["group_name"], per_peer)
            except Exception as e:
                self.watch.uncounted_call(name, e)
        t0 = time.perf_counter()
        try:
            return func(*args, **kwargs)
        finally:
            if threading.get_ident() == self.watch.training_thread:  # only the training thread's blocking counts
                self.watch.wait_s += time.perf_counter() - t0


@contextlib.contextmanager
def watching(
    topology: Topology, functional: bool | None = None, sessions: tuple[CommSession, ...] | list[CommSession] = ()
) -> Iterator[CommWatch]:
    with CommWatch(topology, functional, sessions) as w:
        yield w
