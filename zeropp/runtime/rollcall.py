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
the collective.

A rank that comes to a call the others already gave up on is told apart by the default group's
collective sequence number, which each rank records with its arrival (every rank of a group issues
the same collectives, so it counts alike on every rank at the same point of the program):

- a *late* rank has made the same collectives as the ranks that gave up (its number is theirs): it
  was meant for that very call and came more than ``timeout`` after them (something before it on
  this rank took that long). It raises at once, naming the ranks that gave up on it and how long
  before it they came; the call is void on every rank.
- a rank whose number is higher made a collective together with them since they gave up, so the
  call it missed was one they made alone (``if rank == 0: try: engine.eval_loss(...)``, the error
  caught, then every rank evaluating): that call is void for it, and it takes part in the next
  one, which pairs with their next call. A user's collective between the two (a ``barrier``, the
  next ``train_step``) is what separates the two cases; without one the late reading holds.

The engine runs one before ``eval_loss``, ``save_checkpoint``, ``load_checkpoint`` and
``consolidated_state_dict``, and at stage 3 before the first forward of ``engine.model`` a user
makes outside ``train_step`` / ``eval_loss`` after each engine call (:data:`USER_FORWARD`; not
before every forward: that would add a store round trip to each).

Keys are namespaced per engine by a random token rank 0 draws and broadcasts when the engine is
built. The process group's store can outlive the processes that wrote into it: under
``torchrun --max-restarts`` the agent's shared ``TCPStore`` (torch's default c10d rendezvous keeps
one server for every restart, and ``TORCHELASTIC_USE_AGENT_STORE`` workers connect to it without
a per-attempt prefix; the default group's own prefix, ``default_pg`` and its group name, is the same
in every attempt), a reused ``file://`` store. Without the token a restarted attempt would read
the failed attempt's verdicts (a stale ``go`` would let a rank into a collective alone).

Costs: four or five small store requests per call (on the store's host, next to the collective
the call makes anyway), and one 8-byte broadcast when the engine is built; nothing when the world
has one rank. Each rank counts itself in once it has read a ``go``; rank 0 removes the keys of such
a call at a later call, once every rank has (not sooner: a call can go ahead and then raise alike on
every rank before any collective, and a slow rank may still be reading its verdict). The keys of a
call given up stay, for a rank that comes late.
"""

from __future__ import annotations

import datetime
import secrets
import time
from typing import Iterable

import torch
import torch.distributed as dist

from .batch import on_ranks

CALL_TIMEOUT = datetime.timedelta(minutes=5)
"""``ZeroEngine(call_timeout=...)``'s default: long enough for one rank's host work between two
collective calls (saving a consolidated state dict on rank 0, logging), far below the process
group's 30 minutes."""


USER_FORWARD = "engine.model's forward (outside train_step and eval_loss; at stage 3 it gathers from every rank)"
"""The roll call's name for a stage-3 forward a user makes (``EngineParts._check_user_forward``)."""


def check_timeout(timeout: object) -> None:
    """Refuse a wait that is not a positive ``datetime.timedelta`` (before any rank sends anything)."""
    if not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0:
        raise ValueError(
            f"ZeroEngine(call_timeout=...), how long eval_loss, save_checkpoint, load_checkpoint and "
            f"consolidated_state_dict wait for every rank to call them, must be a positive datetime.timedelta, "
            f"got {timeout!r}; e.g. datetime.timedelta(seconds=60)"
        )


def roll_calls(
    whats: Iterable[str], *, timeout: datetime.timedelta, device: torch.device
) -> dict[str, RollCall | None]:
    """One roll call per name in ``whats`` over the default group, sharing one random key namespace
    (module docstring); collective. None each where there is no one to wait for: one rank, or torch's
    ``fake`` test backend (every collective a no-op, a store without the requests above)."""
    whats = list(whats)
    check_timeout(timeout)
    if dist.get_world_size() == 1 or dist.get_backend() == "fake":
        return {what: None for what in whats}
    token = torch.tensor([secrets.randbits(62) if dist.get_rank() == 0 else 0], dtype=torch.int64, device=device)
    dist.broadcast(token, src=0)  # (not torch's generator: the user's random stream stays as it was)
    namespace = f"zeropp/rollcall/{int(token.item()):x}/"
    return {what: RollCall(what, timeout=timeout, prefix=f"{namespace}{what}/") for what in whats}


def _sequence() -> int | None:
    """The default group's collective sequence number (module docstring), or None where the backend
    does not keep one."""
    try:
        group = torch.distributed.distributed_c10d._get_default_group()
        return int(torch.distributed.ProcessGroup._get_sequence_number_for_group(group))  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):
        return None


class RollCall:
    """Checks, before each call of ``what``, that every rank of the default group called it (module docstring)."""

    def __init__(self, what: str, *, timeout: datetime.timedelta, prefix: str) -> None:
        self.what, self.timeout, self.prefix = what, timeout, prefix
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.store = torch.distributed.distributed_c10d._get_default_store()
        self.calls = 0
        """This rank's next call's number (the same on every rank once void calls are skipped)."""
        self.went_ahead: list[str] = []
        """Rank 0: the key prefixes of its calls that went ahead and whose keys are not removed yet."""

    def check(self) -> None:
        """Return once every rank has called; else raise on every rank that did (before any collective)."""
        seq = _sequence()
        while self._verdict(self.calls) == b"missing":  # given up before this rank came (module docstring)
            call = self._key(self.calls)
            self.calls += 1
            came = self._arrivals(call)
            if seq is not None and any(s >= seq for s, _ in came.values()):
                raise self._late(came)
        if self.went_ahead:
            self._forget_read()
        call = self._key(self.calls)
        self.calls += 1
        self.store.set(f"{call}rank{self.rank}", f"{-1 if seq is None else seq} {time.time():.3f}")
        if self.store.add(f"{call}arrived", 1) == self.world:
            self.store.compare_set(f"{call}verdict", "", "go")
        try:
            self.store.wait([f"{call}verdict"], self.timeout)
        except RuntimeError:  # (DistStoreError; a FileStore's is a plain RuntimeError)
            pass  # the wait ran out: the verdict below is "missing" unless the last rank came just now
        if self.store.compare_set(f"{call}verdict", "", "missing") == b"go":
            self.store.add(f"{call}read", 1)  # (module docstring: when rank 0 removes the keys)
            if self.rank == 0:
                self.went_ahead.append(call)
            return
        present = sorted(self._arrivals(call))
        absent = [r for r in range(self.world) if r not in present]
        raise RuntimeError(
            f"{self.what} is collective, but rank(s) {absent} did not call it within "
            f"{self.timeout.total_seconds():g} s (it was called {on_ranks(present)}), so nothing was sent: call it on "
            f"every rank (not under `if rank == 0:`); every rank that called it raises this (a rank that comes "
            f"later raises at once, naming this call), and the process group is still usable"
        )

    def _late(self, came: dict[int, tuple[int, float]]) -> RuntimeError:
        """The error of a rank that came to a call the ranks ``came`` gave up on before it (module docstring)."""
        before = time.time() - min(t for _, t in came.values())
        wait = self.timeout.total_seconds()
        return RuntimeError(
            f"{self.what} is collective, and this rank came to it late: rank(s) {sorted(came)} called it about "
            f"{before:.0f} s before this rank did, waited call_timeout={wait:g} s for it and gave up, so nothing was "
            f"sent (the call is void on every rank): something before it on this rank took longer "
            f"than call_timeout; if that is expected, raise ZeroEngine(call_timeout=...) above it (or do that work "
            f"on every rank, or after the call); the process group is still usable"
        )

    def _key(self, call: int) -> str:
        return f"{self.prefix}{call}/"

    def _verdict(self, call: int) -> bytes | None:
        key = f"{self._key(call)}verdict"
        return self.store.get(key) if self.store.check([key]) else None

    def _arrivals(self, call: str) -> dict[int, tuple[int, float]]:
        """Rank -> (its collective sequence number, its wall-clock time) of the ranks that came to ``call``."""
        found = {}
        for r in range(self.world):
            if self.store.check([f"{call}rank{r}"]):
                seq, at = self.store.get(f"{call}rank{r}").decode().split()
                found[r] = (int(seq), float(at))
        return found

    def _forget_read(self) -> None:
        """Rank 0: remove the keys of each call that went ahead whose verdict every rank has read."""
        pending = []
        for call in self.went_ahead:
            if self.store.add(f"{call}read", 0) < self.world:
                pending.append(call)
                continue
            for key in ("arrived", "verdict", "read", *(f"rank{r}" for r in range(self.world))):
                self.store.delete_key(f"{call}{key}")
        self.went_ahead = pending
