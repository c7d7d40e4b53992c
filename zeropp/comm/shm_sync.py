"""How the members of a shared-memory transport (``shm.py``) tell each other that a use's rows are
written: a counter per member in the region's header, waited on with a futex.

Each use of the transport needs one synchronisation of its members. Through the backend (a
one-round exchange of one integer, ``control_all_reduce``) that costs gloo about 0.6 ms of CPU per
rank: with a gather and a reduce-scatter per block per step, as much CPU as the data movement it
replaced. Members on one host can instead publish "I wrote use ``k``" by storing ``k`` into their
own counter in the shared region and waking whoever sleeps on it (``FUTEX_WAKE``); a member that
needs a peer's rows sleeps on that peer's counter (``FUTEX_WAIT``, which returns at once if the
counter already moved, so no wake-up is lost) until it reaches ``k``. No spinning: ranks sharing
cores would steal the CPU from the peer they wait for.

Ordering: a member's row copy and its counter store are stores of one thread, and x86-64 keeps
stores in order (and loads in order), so a peer that reads the counter at ``k`` then reads complete
rows; :func:`flags_usable` allows this path on x86-64 Linux only, elsewhere the backend's exchange
is used.

Nothing hangs: a wait sleeps in slices of :data:`SLICE_S`; after each it checks that the peer's
process still runs (pids are exchanged at set-up; a peer that exited or is a zombie raises at once,
naming it) and that the process group's timeout has not passed (then it raises, naming the peer that
never arrived). Ctrl-C interrupts a slice as any system call.
"""

from __future__ import annotations

import ctypes
import os
import platform
import time
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from .backend import control_all_reduce

SLICE_S = 0.05
"""A waiting member checks its peer's process and the deadline this often."""

_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not PRIVATE): the words live in a mapping of several processes
_LINE = 64  # one counter per cache line


class ShmError(RuntimeError):
    """The shared-memory transport cannot be set up or used; the message says what to change."""


def header_bytes(world: int) -> int:
    """The region's header: rank 0's token, then a counter and a pid per member, each on its own line."""
    return -(-_LINE * (2 * world + 1) // 4096) * 4096


def flag_offset(r: int) -> int:
    return _LINE * (1 + r)


def pid_offset(r: int, world: int) -> int:
    return _LINE * (1 + world + r)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def flags_usable() -> bool:
    """Whether this machine can use :class:`FlagSync` (see the module docstring)."""
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")


def process_alive(pid: int) -> bool:
    """Whether ``pid`` is a running (not exited, not zombie) process visible from here."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


class FlagSync:
    """Per-member counters in the header of ``mm``, waited on with futexes (module docstring)."""

    def __init__(
        self, mm: object, *, world: int, rank: int, ranks: list[int], pids: list[int], timeout_s: float
    ) -> None:
        self._words = np.frombuffer(mm, dtype=np.int32, count=header_bytes(world) // 4)  # type: ignore[call-overload]
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(mm))  # type: ignore[arg-type]
        self._world, self._rank, self._ranks, self._pids = world, rank, ranks, pids
        self._timeout_s = timeout_s
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.syscall.restype = ctypes.c_long

    def _flag(self, r: int) -> int:
        return int(self._words[flag_offset(r) // 4])

    def _futex(self, r: int, op: int, value: int, timeout: Optional[_Timespec]) -> None:
        addr = ctypes.c_void_p(self._base + flag_offset(r))
        self._libc.syscall(
            ctypes.c_long(_SYS_FUTEX),
            addr,
            ctypes.c_int(op),
            ctypes.c_int(value),
            ctypes.byref(timeout) if timeout is not None else None,
            None,
            ctypes.c_int(0),
        )

    def start(self, k: int) -> Callable[[], None]:
        """Publish that this member wrote use ``k`` (1, 2, ...); returns the wait for every peer's."""
        k &= 0x7FFFFFFF  # the counters are int32
        self._words[flag_offset(self._rank) // 4] = k
        self._futex(self._rank, _FUTEX_WAKE, 0x7FFFFFFF, None)
        return lambda: self._wait(k)

    def _arrived(self, r: int, k: int) -> bool:
        # a peer is at most one use ahead or behind (module doc of shm.py): k - 1 means not yet
        return (self._flag(r) - k) % (1 << 31) in (0, 1)

    def _wait(self, k: int) -> None:
        deadline = time.monotonic() + self._timeout_s
        ts = _Timespec(0, int(SLICE_S * 1e9))
        for r in range(self._world):
            if r == self._rank:
                continue
            while not self._arrived(r, k):
                seen = self._flag(r)
                if not self._arrived(r, k):
                    self._futex(r, _FUTEX_WAIT, seen, ts)  # returns at once if the counter moved
                if self._arrived(r, k):
                    break
                if not process_alive(self._pids[r]):
                    raise ShmError(
                        f"rank {self._ranks[r]} (pid {self._pids[r]}) exited while rank {self._ranks[self._rank]} "
                        f"waited for it in a shared-memory collective (zero.transport=shm)"
                    )
                if time.monotonic() > deadline:
                    raise ShmError(
                        f"rank {self._ranks[self._rank]} waited {self._timeout_s:.0f} s (the transport's timeout) "
                        f"for rank {self._ranks[r]} in a shared-memory collective it never reached "
                        f"(zero.transport=shm): the ranks did not issue the same collectives"
                    )


class BackendSync:
    """The synchronisation through the backend: a one-round exchange of one integer per use."""

    def __init__(self, group: Optional[dist.ProcessGroup]) -> None:
        self._group = group
        self._flag = torch.zeros(1, dtype=torch.int64)

    def start(self, k: int) -> Callable[[], None]:
        self._flag.zero_()
        return control_all_reduce(self._flag, "max", self._group, async_op=True)


def publish_pid(mm: object, world: int, rank: int) -> None:
    """Write this process's pid into member ``rank``'s slot of the header."""
    words = np.frombuffer(mm, dtype=np.int64, count=header_bytes(world) // 8)  # type: ignore[call-overload]
    words[pid_offset(rank, world) // 8] = os.getpid()


def read_pids(mm: object, world: int) -> list[int]:
    words = np.frombuffer(mm, dtype=np.int64, count=header_bytes(world) // 8)  # type: ignore[call-overload]
    return [int(words[pid_offset(r, world) // 8]) for r in range(world)]
