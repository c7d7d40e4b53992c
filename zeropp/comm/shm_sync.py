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

Ordering: a member's row copy has finished (torch's intra-op workers joined) before its thread
stores the counter, and x86-64 keeps a thread's stores in order and its loads in order, so a peer
that reads the counter at ``k`` then reads complete rows; :func:`flags_usable` allows this path on
x86-64 Linux only, elsewhere the backend's exchange is used. Each member also publishes a digest of
the use (:func:`describe`: operation, dtype, sizes, chunk) beside its counter; a peer whose use
``k`` is another collective raises on both sides instead of reading unrelated rows. Members must
also share a pid namespace (:func:`peers_visible`), else the liveness check below would watch
other processes and the backend's exchange is used.

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
import zlib
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from .backend import control_all_reduce

SLICE_S = 0.05
"""A waiting member checks its peer's process and the deadline this often."""
PEER_EXITED = "exited while rank"
"""The words of the error a member raises when the peer it waits for has exited (the launcher
counts such a rank as stopped by a peer, not failing: ``experiments/launch/failure.PEER_ERRORS``)."""

_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not PRIVATE): the words live in a mapping of several processes
_LINE = 64  # one counter per cache line


class ShmError(RuntimeError):
    """The shared-memory transport cannot be set up or used; the message says what to change."""

    def __init__(self, message: str, *, cause: str = "") -> None:
        super().__init__(message)
        self.cause = cause or message
        """What went wrong, without the message's advice (what a fallback to the backend quotes)."""


def describe(*parts: object) -> int:
    """A use's descriptor: a signed 32-bit digest of what the collective is (operation, dtype, sizes,
    chunk), which every member publishes with its counter so that members issuing different
    collectives at the same point raise instead of reading each other's unrelated rows."""
    digest = zlib.crc32(repr(parts).encode())
    return digest - (1 << 32) if digest >= 1 << 31 else digest


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

    def start(self, k: int, desc: int) -> Callable[[], None]:
        """Publish that this member wrote use ``k`` (1, 2, ...) described by ``desc`` (:func:`describe`);
        returns the wait for every peer's, which raises if a peer's use ``k`` is another collective."""
        k &= 0x7FFFFFFF  # the counters are int32
        mine = flag_offset(self._rank) // 4
        self._words[mine + 1 + k % 2] = desc  # before the counter: a peer that sees k reads it
        self._words[mine] = k
        self._futex(self._rank, _FUTEX_WAKE, 0x7FFFFFFF, None)
        return lambda: self._wait(k, desc)

    def _arrived(self, r: int, k: int) -> bool:
        # a peer is at most one use ahead or behind (module doc of shm.py): k - 1 means not yet
        return (self._flag(r) - k) % (1 << 31) in (0, 1)

    def _wait(self, k: int, desc: int) -> None:
        deadline = time.monotonic() + self._timeout_s
        ts = _Timespec(0, int(SLICE_S * 1e9))
        for r in range(self._world):
            if r == self._rank:
                continue
            self._wait_for(r, k, deadline, ts)
            # a peer's descriptor of use k stays in its slot k % 2 until its use k + 2, which needs this rank's k + 1
            theirs = int(self._words[flag_offset(r) // 4 + 1 + k % 2])
            if theirs != desc:
                raise ShmError(
                    f"rank {self._ranks[r]} issued another shared-memory collective than rank "
                    f"{self._ranks[self._rank]} at the same point (zero.transport=shm): every rank must issue the "
                    f"same collectives, with the same sizes and dtypes, in the same order"
                )

    def _wait_for(self, r: int, k: int, deadline: float, ts: _Timespec) -> None:
        while not self._arrived(r, k):
            seen = self._flag(r)
            if not self._arrived(r, k):
                self._futex(r, _FUTEX_WAIT, seen, ts)  # returns at once if the counter moved
            if self._arrived(r, k):
                break
            if not process_alive(self._pids[r]):
                raise ShmError(
                    f"rank {self._ranks[r]} (pid {self._pids[r]}) {PEER_EXITED} {self._ranks[self._rank]} "
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
        self._flag = torch.zeros(2, dtype=torch.int64)  # [desc, -desc]: their max is -(min) when all agree

    def start(self, k: int, desc: int) -> Callable[[], None]:
        flag = self._flag
        flag[0], flag[1] = desc, -desc
        done = control_all_reduce(flag, "max", self._group, async_op=True)

        def wait() -> None:
            done()
            if int(flag[0]) != -int(flag[1]):
                raise ShmError(
                    "the ranks issued different shared-memory collectives at the same point (zero.transport=shm): "
                    "every rank must issue the same collectives, with the same sizes and dtypes, in the same order"
                )

        return wait


def pid_namespace() -> int:
    """This process's pid namespace (the inode of ``/proc/self/ns/pid``; 0 where it cannot be read)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def publish_pid(mm: object, world: int, rank: int) -> None:
    """Write this process's pid and pid namespace into member ``rank``'s line of the header."""
    words = np.frombuffer(mm, dtype=np.int64, count=header_bytes(world) // 8)  # type: ignore[call-overload]
    at = pid_offset(rank, world) // 8
    words[at], words[at + 1] = os.getpid(), pid_namespace()


def read_pids(mm: object, world: int) -> list[tuple[int, int]]:
    """Every member's ``(pid, pid namespace)`` as :func:`publish_pid` wrote them."""
    words = np.frombuffer(mm, dtype=np.int64, count=header_bytes(world) // 8)  # type: ignore[call-overload]
    return [(int(words[pid_offset(r, world) // 8]), int(words[pid_offset(r, world) // 8 + 1])) for r in range(world)]


def peers_visible(pids: list[tuple[int, int]]) -> bool:
    """Whether this process can watch every member's process: all in its pid namespace (a pid from
    another namespace names some other process here) and running."""
    ns = pid_namespace()
    return ns != 0 and all(n == ns and process_alive(p) for p, n in pids)
