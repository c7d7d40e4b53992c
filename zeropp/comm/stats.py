"""Byte accounting: what each rank hands to the backend, by collective kind and link class.

Convention (per rank, per call; counted from the tensors actually passed to the backend):

- all-gather: my contribution (``input.nbytes``, or the packed quantized bytes) once to each
  *other* member of the group;
- all-to-all: each chunk I pass for another member (the chunk for myself counts 0);
- reduce-scatter (plain backend call): chunk ``j`` of my input (``input.nbytes / group_size``)
  to member ``j`` for each other member ``j`` -- what a direct (all-to-all style) algorithm
  sends; ring or tree schedules move the same total per rank but through other routes;
- all-reduce (plain): a reduce-scatter followed by an all-gather of the reduced chunk, i.e.
  ``2 * nbytes / group_size`` to each other member.

- broadcast / scatter: the whole message to each other member, from the root only;
- reduce / gather: my message to the root, from each non-root member.

:func:`peer_bytes` turns one call into these per-member amounts; zeropp's collectives and
``experiments/runner/commwatch.py`` both use it, so the rules live in one place.

Each per-peer amount is classified ``"intra"`` if the peer is on this rank's node under the
topology in use, ``"cross"`` otherwise. Self-sends are never counted, so a one-rank group
records nothing. Only this rank's sends are recorded: sum over ranks for the world's traffic.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Iterable, Optional, Sequence

import torch.distributed as dist

from .topology import Topology

LINKS = ("intra", "cross")


class CommStats:
    """Bytes sent by this rank, keyed by ``(kind, link)``; thread-safe, cheap to snapshot."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes: dict[tuple[str, str], int] = defaultdict(int)
        self._calls: dict[str, int] = defaultdict(int)

    def record(self, kind: str, link: str, nbytes: int) -> None:
        if link not in LINKS:
            raise ValueError(f"link must be one of {LINKS}, got {link!r}")
        with self._lock:
            self._bytes[(kind, link)] += int(nbytes)

    def count_call(self, kind: str) -> None:
        with self._lock:
            self._calls[kind] += 1

    def snapshot(self) -> dict[str, dict[str, int]]:
        """``{kind: {"intra": bytes, "cross": bytes}}`` (a copy; kinds with traffic or calls)."""
        with self._lock:
            kinds = {k for k, _ in self._bytes} | set(self._calls)
            return {k: {ln: self._bytes.get((k, ln), 0) for ln in LINKS} for k in sorted(kinds)}

    def calls(self) -> dict[str, int]:
        """Calls per kind of the zeropp.comm collectives (a ``quantized_all_reduce`` counts its
        reduce-scatter and its all-gather)."""
        with self._lock:
            return dict(self._calls)

    def total(self, link: Optional[str] = None, kind: Optional[str] = None) -> int:
        """Bytes summed over the kinds/links not fixed by the arguments."""
        if link is not None and link not in LINKS:
            raise ValueError(f"link must be one of {LINKS} or None, got {link!r}")
        with self._lock:
            return sum(
                b for (k, ln), b in self._bytes.items() if (link is None or ln == link) and (kind is None or k == kind)
            )

    def reset(self) -> None:
        with self._lock:
            self._bytes.clear()
            self._calls.clear()

    def merge(self, other: CommStats) -> None:
        """Add another CommStats' counts into this one."""
        snap, calls = other.snapshot(), other.calls()
        for k, links in snap.items():
            for ln, b in links.items():
                if b:
                    self.record(k, ln, b)
        with self._lock:
            for k, c in calls.items():
                self._calls[k] += c

    def __repr__(self) -> str:
        return f"CommStats({self.snapshot()})"


_DEFAULT_STATS = CommStats()


def get_comm_stats() -> CommStats:
    """The default session's CommStats (``session.default_session``): what plain collective calls
    made without ``session=`` or ``stats=`` record into. An engine or plug-in records into its own."""
    return _DEFAULT_STATS


def group_ranks(group: Optional[dist.ProcessGroup]) -> list[int]:
    """Global ranks of ``group`` in group-rank order (``None`` = the default group)."""
    g = dist.group.WORLD if group is None else group
    return list(dist.get_process_group_ranks(g))


def record_sends(
    stats: Optional[CommStats],
    kind: str,
    topology: Topology,
    peers: Iterable[int],
    nbytes_per_peer: Iterable[int] | int,
) -> None:
    """Record ``nbytes`` to each global rank in ``peers`` (self excluded), classified by node."""
    stats = _DEFAULT_STATS if stats is None else stats
    me = dist.get_rank()
    peers = list(peers)
    sizes = [nbytes_per_peer] * len(peers) if isinstance(nbytes_per_peer, int) else list(nbytes_per_peer)
    intra = cross = 0
    for p, b in zip(peers, sizes):
        if p == me:
            continue
        if topology.same_node(me, p):
            intra += b
        else:
            cross += b
    if intra:
        stats.record(kind, "intra", intra)
    if cross:
        stats.record(kind, "cross", cross)


PEER_BYTES_KINDS = (
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "scatter",
    "reduce",
    "gather",
)


def peer_bytes(
    kind: str,
    nbytes: int,
    group_size: int,
    *,
    splits: Optional[Sequence[int]] = None,
    rank: Optional[int] = None,
    root: Optional[int] = None,
) -> list[int]:
    """Bytes this rank sends to each group member (index = group rank) for one collective call,
    under the module's convention. Feed the result to :func:`record_sends` (which drops self).

    ``nbytes``: all_gather -- my contribution; reduce_scatter / all_reduce / all_to_all -- my whole
    input buffer; broadcast / scatter / reduce / gather -- the message. ``splits``: per-member bytes
    for an uneven all_to_all or a list-input reduce_scatter (padded with 0 / cut to ``group_size``;
    ``nbytes`` is then ignored). ``rank`` / ``root``: my group rank and the root's, required for
    broadcast, scatter, reduce and gather (``root`` outside the group sends nothing). When
    ``rank`` is given its own entry is 0. A group of one sends nothing.
    """
    if kind not in PEER_BYTES_KINDS:
        raise ValueError(f"peer_bytes: kind must be one of {PEER_BYTES_KINDS}, got {kind!r}")
    g = int(group_size)
    if g < 0:
        raise ValueError(f"peer_bytes: group_size must be >= 0, got {group_size}")
    if nbytes < 0:
        raise ValueError(f"peer_bytes: nbytes must be >= 0, got {nbytes}")
    if g <= 1:
        return [0] * g
    if kind in ("broadcast", "scatter", "reduce", "gather") and (rank is None or root is None):
        raise ValueError(f"peer_bytes: kind {kind!r} needs rank= and root= (group ranks of this rank and the root)")
    nbytes = int(nbytes)
    if splits is not None and kind in ("all_to_all", "reduce_scatter"):
        out = [int(s) for s in splits][:g]
        out += [0] * (g - len(out))
    elif kind == "all_gather":
        out = [nbytes] * g
    elif kind in ("reduce_scatter", "all_to_all"):
        out = [nbytes // g] * g
    elif kind == "all_reduce":
        out = [2 * nbytes // g] * g
    elif kind in ("broadcast", "scatter"):
        out = [nbytes] * g if rank == root else [0] * g
    else:  # reduce, gather
        out = [0] * g
        if rank != root and 0 <= root < g:
            out[root] = nbytes
    if rank is not None and 0 <= rank < g:
        out[rank] = 0
    return out
