"""Measure communication from outside any trainer: bytes per link class and time blocked on it.

Every trainer (zeropp's engine, FSDP2, DDP, plug-ins) ends up in ``torch.distributed``'s
collectives. :class:`CommWatch` wraps those functions and ``Work.wait`` in this process, and
records, per collective kind and link class (``intra`` / ``cross`` node, from the run's topology),
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
  ``Work.wait()``. That is the time communication is *not* overlapped with compute.

Nested calls (a collective implemented with another) are counted once, at the outermost call.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from zeropp.comm import CommStats, Topology
from zeropp.comm.chain import Deferred
from zeropp.comm.stats import peer_bytes, record_sends

_WRAPPED = ("all_gather_into_tensor", "all_gather_single", "_all_gather_base", "all_gather", "reduce_scatter_tensor",
            "reduce_scatter_single", "_reduce_scatter_base", "reduce_scatter", "all_reduce",
            "all_to_all_single", "all_to_all", "broadcast", "reduce", "gather", "scatter")


def _nbytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[i] if len(args) > i else default


def _peer_bytes(name: str, args: tuple, kwargs: dict, ranks: list[int], me: int) -> list[int]:
    """Bytes this rank sends to each group member (index = group rank) for one call: reads the
    message sizes off the call's arguments; the per-collective rules are zeropp.comm.stats.peer_bytes."""
    g = len(ranks)
    if g <= 1:
        return [0] * g
    kind, nbytes, splits, root = _kind(name), 0, None, None
    if name in ("all_gather_into_tensor", "all_gather_single", "_all_gather_base"):
        nbytes = _nbytes(_arg(args, kwargs, 1, "input_tensor"))
    elif name == "all_gather":
        nbytes = _nbytes(_arg(args, kwargs, 1, "tensor"))
    elif name in ("reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base"):
        nbytes = _nbytes(_arg(args, kwargs, 1, "input"))
    elif name == "reduce_scatter":
        splits = [_nbytes(t) for t in (_arg(args, kwargs, 1, "input_list") or [])]
    elif name == "all_reduce":
        nbytes = _nbytes(_arg(args, kwargs, 0, "tensor"))
    elif name == "all_to_all_single":
        inp = _arg(args, kwargs, 1, "input")
        in_splits = _arg(args, kwargs, 3, "input_split_sizes")
        nbytes = _nbytes(inp)
        if in_splits:
            per_row = nbytes // max(1, inp.shape[0]) if inp is not None and inp.dim() else 0
            splits = [int(s) * per_row for s in in_splits]
    elif name == "all_to_all":
        splits = [_nbytes(t) for t in (_arg(args, kwargs, 1, "input_tensor_list") or [])]
    elif name in ("broadcast", "scatter", "reduce", "gather"):
        nbytes = _nbytes(_arg(args, kwargs, 0, "tensor"))
        src = _arg(args, kwargs, 1 if name in ("broadcast", "reduce") else 2, "dst" if name in ("reduce", "gather") else "src", 0)
        if src not in ranks:
            return [0] * g
        root = ranks.index(src)
    return peer_bytes(kind, nbytes, g, splits=splits, rank=me, root=root)


def _kind(name: str) -> str:
    return (name.lstrip("_").replace("_into_tensor", "").replace("_base", "").replace("_tensor", "")
            .replace("_single", ""))


class CommWatch:
    """Patch torch.distributed for this process while active (see module doc).

    ``topology`` (zeropp.comm.Topology) classifies each peer as intra- or cross-node. Use as a
    context manager; ``take()`` returns and resets the counters (one step's worth); ``stats`` is
    the underlying CommStats.
    """

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.stats = CommStats()
        self.wait_s = 0.0
        self._local = threading.local()
        self._thread = threading.get_ident()
        self._lock = threading.Lock()  # zeropp's comm worker thread issues collectives too
        self._saved: list[tuple[Any, str, Any]] = []

    # -- bookkeeping ---------------------------------------------------------------------
    def _account(self, name: str, args: tuple, kwargs: dict) -> None:
        group = kwargs.get("group")
        if group is None:
            idx = {"all_gather_into_tensor": 2, "all_gather_single": 2, "_all_gather_base": 2, "all_gather": 2,
                   "reduce_scatter_tensor": 3, "reduce_scatter_single": 3, "_reduce_scatter_base": 3,
                   "reduce_scatter": 3, "all_reduce": 2, "all_to_all_single": 4, "all_to_all": 2,
                   "broadcast": 2, "reduce": 3, "gather": 3, "scatter": 3}[name]
            group = args[idx] if len(args) > idx and not isinstance(args[idx], (bool, int)) else None
        try:
            ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        except Exception:  # noqa: BLE001 - an exotic group: count it as world
            ranks = list(range(dist.get_world_size()))
        me_global = dist.get_rank()
        if me_global not in ranks:
            return
        kind = _kind(name)
        record_sends(self.stats, kind, self.topology, ranks, _peer_bytes(name, args, kwargs, ranks, ranks.index(me_global)))
        self.stats.count_call(kind)

    def _wrap(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._local, "depth", 0):
                return fn(*args, **kwargs)
            self._local.depth = 1
            t0 = time.perf_counter()
            try:
                with contextlib.suppress(Exception), self._lock:
                    self._account(name, args, kwargs)
                return fn(*args, **kwargs)
            finally:
                if threading.get_ident() == self._thread:  # only the training thread's blocking counts
                    self.wait_s += time.perf_counter() - t0
                self._local.depth = 0
        return wrapper

    def _wrap_wait(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            if getattr(self._local, "depth", 0) or threading.get_ident() != self._thread:
                return fn(work, *args, **kwargs)
            self._local.depth = 1
            t0 = time.perf_counter()
            try:
                return fn(work, *args, **kwargs)
            finally:
                self.wait_s += time.perf_counter() - t0
                self._local.depth = 0
        return wait

    # -- lifecycle -----------------------------------------------------------------------
    def __enter__(self) -> "CommWatch":
        self._thread = threading.get_ident()
        wrappers: dict[str, Callable] = {}
        for name in _WRAPPED:
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
        # waiting for a continuation that zeropp's comm worker runs (qgZ's cross-node hop) blocks too
        self._saved.append((Deferred, "wait", Deferred.wait))
        Deferred.wait = self._wrap_wait(Deferred.wait)  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        for obj, name, fn in reversed(self._saved):
            setattr(obj, name, fn)
        self._saved.clear()

    def take(self) -> tuple[dict[str, int], float]:
        """``({"<kind>.<link>": bytes}, wait_seconds)`` since the last call; resets both."""
        with self._lock:
            b = {f"{k}.{ln}": v for k, links in self.stats.snapshot().items() for ln, v in links.items() if v}
            w = self.wait_s
            self.stats.reset()
            self.wait_s = 0.0
        return b, w


@contextlib.contextmanager
def watching(topology: Topology) -> Iterator[CommWatch]:
    with CommWatch(topology) as w:
        yield w
