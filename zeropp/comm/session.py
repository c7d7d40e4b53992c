"""The communication state of one engine or plug-in, owned by one object: :class:`CommSession`.

What a session holds (FSDP2's ``FSDPCommContext`` plays this part for its streams):

- the :class:`~.topology.Topology` its calls route and account by, and its process groups
  (:meth:`CommSession.groups`, built collectively at first use and cached by the topology);
- the :class:`~.stats.CommStats` its calls record their bytes into;
- the stochastic-rounding call counter of the seed rule (``stochastic.py``), so two engines in one
  process each draw the noise they would draw alone;
- the CUDA side streams its continuations run on (``chain.py``: a later qgZ hop, the DDP hook's
  all-reduce);
- its wait hooks (:meth:`CommSession.add_wait_hook`): every wait on a handle its calls returned
  runs inside them, so a profiler of exposed communication (``experiments/runner/commwatch.py``) times
  waits without patching zeropp's classes;
- whether its calls check that every rank of the group made the same call
  (:attr:`CommSession.check_collectives`, ``callcheck.py``; by default the process's
  ``ZEROPP_DEBUG_COLLECTIVES`` setting).

The engine creates one (``zeropp.runtime.collectives.EngineComm.session``), the FSDP2 and DDP
plug-ins create one per model / hook state or are given one. The *process's* lifetime object,
the comm worker thread and the buffers held for the backend (``context.CommContext``), stays one per
process: its reason is interpreter-exit safety, which is per process.

A plain collective called without ``session=`` uses :func:`default_session`: a thin convenience
whose stats are ``stats.get_comm_stats()``, whose counter is the one
``stochastic.stochastic_calls()`` reads, whose topology is ``topology.get_topology()`` and whose
side streams are the process context's. Nothing else uses it.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch
from torch.utils.hooks import RemovableHandle

from . import context
from .shm_choice import TransportChoice
from .stats import CommStats, get_comm_stats
from .stochastic import DEFAULT_COUNTER, StochasticCounter
from .topology import Topology, TopologyGroups, resolve_topology

__all__ = ["CommSession", "SendHook", "WaitHook", "default_session"]

WaitHook = Callable[[str], ContextManager[None]]
"""A wait hook: called with the waited collective's ``kind`` just before the wait, on the waiting
thread; the wait runs inside the context manager it returns (so it can time the wait, and see
the backend waits nested in it as part of it)."""

SendHook = Callable[[str, list[int], list[int]], None]
"""A send hook: told of each call the session's owner carries past ``torch.distributed`` (the
engine's shared-memory route), with the kind of the ``torch.distributed`` call it replaces
(``all_gather``, ``all_reduce``, ``all_to_all`` for a reduce-scatter on gloo), the group's global
ranks and the bytes this rank sends to each member (``stats.peer_bytes``), so an outside count of
the process's communication sees those bytes as it sees the backend's."""


class CommSession:
    """Topology and groups, byte counts, stochastic-rounding counter, side streams and wait hooks
    of one engine or plug-in (see the module docstring).

    ``topology``: None routes and accounts by the process-wide default (``set_topology``), else one
    node holding the whole world, resolved at each call. ``stats``: where the bytes go (a new
    :class:`CommStats` by default). ``check_collectives``: see the attribute (None: the process's
    ``ZEROPP_DEBUG_COLLECTIVES`` setting). Create it on the thread that trains; it may be used from
    the comm worker thread too (the counter and the stats are thread-safe)."""

    def __init__(
        self,
        topology: Optional[Topology] = None,
        *,
        stats: Optional[CommStats] = None,
        check_collectives: Optional[bool] = None,
    ) -> None:
        if topology is not None and not isinstance(topology, Topology):
            raise TypeError(
                f"CommSession topology must be a zeropp.comm.Topology or None, got {type(topology).__name__}"
            )
        if stats is not None and not isinstance(stats, CommStats):
            raise TypeError(f"CommSession stats must be a zeropp.comm.CommStats or None, got {type(stats).__name__}")
        self.topology = topology
        """The topology of this session's calls (None: the process-wide default at each call)."""
        self.stats = stats if stats is not None else CommStats()
        """Bytes and calls of this session's collectives, by kind and link."""
        self.transport: Optional[TransportChoice] = None
        """What carries the owner's plain collectives, as requested and as resolved, when the owner
        chose one (the engine: ``ZeroConfig.transport``; ``shm_auto.TransportChoice``); None: the
        backend, nothing chosen."""
        self._check = None if check_collectives is None else bool(check_collectives)
        self.stochastic = self._new_counter()
        """The seed rule's call counter of this session (``stochastic.StochasticCounter``)."""
        self._lock = threading.Lock()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._wait_hooks: collections.OrderedDict[int, WaitHook] = collections.OrderedDict()  # RemovableHandle's kind
        self._send_hooks: collections.OrderedDict[int, SendHook] = collections.OrderedDict()

    def _new_counter(self) -> StochasticCounter:
        return StochasticCounter()

    # -------------------------------------------------------------- topology and groups
    def resolve_topology(self, topology: Optional[Topology] = None) -> Topology:
        """``topology`` if given, else this session's, else the process default, else one node;
        checked against the default group's size."""
        return resolve_topology(topology if topology is not None else self.topology)

    def groups(self) -> TopologyGroups:
        """This rank's intra / cross / hpZ / dp groups under the session's topology (collective the
        first time in a world: every rank must call it; cached afterwards)."""
        return self.resolve_topology().build()

    # -------------------------------------------------------------- call checks
    @property
    def check_collectives(self) -> bool:
        """Collectives debug mode (``callcheck.py``): every public collective of this session first
        exchanges a fingerprint of its call among the group's ranks and raises the same ValueError
        on every rank when they differ. One small exchange per call, so off by default; it must be
        on on every rank of a group or on none. Unset (None), the process's
        ``ZEROPP_DEBUG_COLLECTIVES`` setting, read once per process (``context.py``)."""
        return context.current().debug_collectives if self._check is None else self._check

    @check_collectives.setter
    def check_collectives(self, on: Optional[bool]) -> None:
        self._check = None if on is None else bool(on)

    # -------------------------------------------------------------- side streams
    def side_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The CUDA side stream this session's continuations run on (created at first use)."""
        with self._lock:
            s = self._streams.get(device)
            if s is None:
                s = self._streams[device] = torch.cuda.Stream(device)
            return s

    # -------------------------------------------------------------- wait hooks
    def add_wait_hook(self, hook: WaitHook) -> RemovableHandle:
        """Run every wait on a handle of this session's calls inside ``hook(kind)`` (see
        :data:`WaitHook`); returns a handle whose ``remove()`` takes the hook off again."""
        return _register(self._wait_hooks, hook, "add_wait_hook expects callable(kind) -> context manager")

    @contextlib.contextmanager
    def waiting(self, kind: str) -> Iterator[None]:
        """The context a wait on a ``kind`` collective of this session runs in: the hooks' contexts,
        entered in the order the hooks were added."""
        hooks = list(self._wait_hooks.values())
        if not hooks:
            yield
            return
        with contextlib.ExitStack() as stack:
            for hook in hooks:
                stack.enter_context(hook(kind))
            yield

    # -------------------------------------------------------------- send hooks
    def add_send_hook(self, hook: SendHook) -> RemovableHandle:
        """Tell ``hook`` of every call this session's owner carries past ``torch.distributed`` (see
        :data:`SendHook`); returns a handle whose ``remove()`` takes the hook off again."""
        return _register(self._send_hooks, hook, "add_send_hook expects callable(kind, ranks, per_peer)")

    def sent(self, kind: str, ranks: list[int], per_peer: list[int]) -> None:
        """One call carried past ``torch.distributed``: every send hook is told (see :data:`SendHook`)."""
        for hook in list(self._send_hooks.values()):
            hook(kind, ranks, per_peer)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(topology={self.topology}, stochastic_calls={self.stochastic.value}, "
            f"wait_hooks={len(self._wait_hooks)})"
        )


def _register(hooks: dict[int, Any], hook: object, expects: str) -> RemovableHandle:
    """Add ``hook`` to ``hooks`` (a session's wait or send hooks) under a handle whose ``remove()``
    takes it off again; ``expects`` is the error's start when ``hook`` is not callable."""
    if not callable(hook):
        raise TypeError(f"{expects}, got {type(hook).__name__}")
    handle = RemovableHandle(hooks)
    hooks[handle.id] = hook
    return handle


class _DefaultSession(CommSession):
    """The session of plain calls made without one: the process-wide stats, counter, default
    topology and the process context's side streams (module docstring)."""

    def __init__(self) -> None:
        super().__init__(None, stats=get_comm_stats())

    def _new_counter(self) -> StochasticCounter:
        return DEFAULT_COUNTER

    def side_stream(self, device: torch.device) -> torch.cuda.Stream:
        return context.current().side_stream(device)


_DEFAULT = _DefaultSession()


def default_session() -> CommSession:
    """The session of collective calls made without ``session=`` (a convenience for plain calls;
    engines and plug-ins have their own)."""
    return _DEFAULT


def resolve(session: Optional[CommSession]) -> CommSession:
    """``session``, else the default one; a wrong type is a TypeError naming what to pass."""
    if session is None:
        return _DEFAULT
    if not isinstance(session, CommSession):
        raise TypeError(f"session must be a zeropp.comm.CommSession or None, got {type(session).__name__}")
    return session
