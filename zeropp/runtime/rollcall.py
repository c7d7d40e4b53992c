"""A bounded check, before a collective a user may call on some ranks only, that every rank called it.

``engine.eval_loss(batch)`` is collective (the loss is averaged over the ranks; stage 3's forward
gathers every block from every rank), and the way many DDP scripts evaluate -- ``if rank == 0:``
-- leaves that rank in the first collective until the process group's timeout (30 minutes by
default), then fails in the backend's words. A :class:`RollCall` runs before such a call: each rank
registers its arrival in the process group's store and waits, at most ``timeout``, for the others;
a rank that waited in vain raises one clear error naming the ranks that did not come, before it
sends anything, so the process group itself stays in step.

The verdict is taken once per call, atomically in the store (``compare_set`` on one key): the last
rank to arrive writes ``go``; a rank whose wait ran out writes ``missing``. Whichever is written
first holds for every rank that took part, so a rank that gave up cannot leave the others inside
the collective. A call given up before a rank came is void for that rank: it takes part in the
next call instead, so the ranks stay in step (rank 0 evaluating alone, then every rank evaluating,
pairs the second calls).

Costs: three or four small store requests per call (on the store's host, next to the collective
the call makes anyway); nothing when the world has one rank. The keys of a call that went ahead
are removed by rank 0's next call (every rank has read that verdict by then: it made the
collective that followed it); those of a call given up stay, for a rank that comes late.
"""

from __future__ import annotations

import datetime
import itertools

import torch
import torch.distributed as dist

from .batch import on_ranks

CALL_TIMEOUT = datetime.timedelta(minutes=5)
"""``ZeroEngine(call_timeout=...)``'s default: long enough for one rank's host work between two
collective calls (saving a consolidated state dict on rank 0, logging), far below the process
group's 30 minutes."""

_NAMES = itertools.count()
"""Roll calls made in this process, in order: every rank makes its engines in the same order."""


class RollCall:
    """Checks, before each call of ``what``, that every rank of the default group called it (module docstring)."""

    def __init__(self, what: str, *, timeout: datetime.timedelta) -> None:
        self.what, self.timeout = what, timeout
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.store = torch.distributed.distributed_c10d._get_default_store()
        self.prefix = f"zeropp/rollcall/{next(_NAMES)}/"
        self.calls = 0
        """This rank's next call's number (the same on every rank once void calls are skipped)."""
        self.went_ahead: str | None = None
        """The key prefix of this rank's last call if it went ahead (rank 0 removes its keys next call)."""

    @classmethod
    def for_world(cls, what: str, *, timeout: datetime.timedelta) -> RollCall | None:
        """A roll call over the default group, or None where there is no one to wait for: one rank,
        or torch's ``fake`` test backend (every collective a no-op, a store without the requests above)."""
        if not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0:
            raise ValueError(
                f"the wait for every rank to call {what} must be a positive datetime.timedelta, got {timeout!r}; "
                f"e.g. datetime.timedelta(seconds=60)"
            )
        if dist.get_world_size() == 1 or dist.get_backend() == "fake":
            return None
        return cls(what, timeout=timeout)

    def check(self) -> None:
        """Return once every rank has called; else raise on every rank that did (before any collective)."""
        while self._verdict(self.calls) == b"missing":  # given up before this rank came: void (module docstring)
            self.calls += 1
        if self.rank == 0 and self.went_ahead is not None:
            self._forget(self.went_ahead)
        call, self.went_ahead = self._key(self.calls), None
        self.calls += 1
        self.store.set(f"{call}rank{self.rank}", "1")
        if self.store.add(f"{call}arrived", 1) == self.world:
            self.store.compare_set(f"{call}verdict", "", "go")
        try:
            self.store.wait([f"{call}verdict"], self.timeout)
        except RuntimeError:  # (DistStoreError; a FileStore's is a plain RuntimeError)
            pass  # the wait ran out: the verdict below is "missing" unless the last rank came just now
        if self.store.compare_set(f"{call}verdict", "", "missing") == b"go":
            self.went_ahead = call
            return
        came = [r for r in range(self.world) if self.store.check([f"{call}rank{r}"])]
        absent = [r for r in range(self.world) if r not in came]
        raise RuntimeError(
            f"{self.what} is collective, but rank(s) {absent} did not call it within "
            f"{self.timeout.total_seconds():g} s (it was called {on_ranks(came)}), so nothing was sent: call it on "
            f"every rank (not under `if rank == 0:`); every rank that called it raises this, and the process "
            f"group is still usable"
        )

    def _key(self, call: int) -> str:
        return f"{self.prefix}{call}/"

    def _verdict(self, call: int) -> bytes | None:
        key = f"{self._key(call)}verdict"
        return self.store.get(key) if self.store.check([key]) else None

    def _forget(self, call: str) -> None:
        """Remove the keys of a call that went ahead (every rank is past its verdict)."""
        for key in ("arrived", "verdict", *(f"rank{r}" for r in range(self.world))):
            self.store.delete_key(f"{call}{key}")
