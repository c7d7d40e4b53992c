"""Plain collectives of one process group through a region of shared memory (CPU ranks, one host).

On CPU ranks gloo moves every byte through loopback TCP: a copy into the kernel, a copy out, and
wake-ups of each rank's gloo threads. With 4 ranks of a 3.3M-parameter model on 2 cores, gloo's
threads and the kernel took about a tenth of all CPU of a training step, as much for zeropp's
gathers and reduce-scatters as for DDP's all-reduce. Ranks on one host can instead read each
other's values from memory they all map: a rank writes its part once, every rank reads what it
needs, and one synchronisation per chunk tells it when (``shm_sync.py``: a futex on a counter per
rank in the region, or the backend's one-round exchange where that cannot be used). What that
saves on the ``bench_peers`` job is in ``docs/benchmarks.md``.

torch has no shared-memory transport for CPU tensors (gloo's is TCP; oneCCL and MPI are separate
installs), so it is written here; it moves plain values only, the quantized collectives keep
the backend.

**The region.** Group rank 0 creates a file under ``/dev/shm`` (``mkstemp``: a fresh name, mode
0600, registered with the launcher's scratch cleanup) of ``region_bytes`` (by default an eighth of
the free space there, 32-64 MiB: :func:`region_bytes_for`); every member opens it
without following links, checks that it is a regular file of this user and of that size, and maps
it; after every member mapped it, rank 0 unlinks it, so from then on nothing is left on disk
whatever happens to the ranks. A random token rank 0 writes into the region and sends through the
backend proves that every member maps the same memory (ranks on other hosts or in other
containers do not); otherwise every member raises the same error.

**Two slots, one use in flight.** After a header (rank 0's token, a counter and a pid per member),
the region is two slots of ``[W, R]`` bytes (``W`` members, ``R``
a row). A *use* writes this rank's row of one slot, then starts the synchronisation; the next use
(or a wait) first finishes that synchronisation and runs the use's read. Uses alternate slots, and
a rank completes its previous use (synchronisation and read) before it writes again, so when a
rank writes slot ``k % 2`` every member has finished use ``k - 1``'s synchronisation, which each
member started only after completing use ``k - 2``, the last one to read that slot. A collective
larger than a row is cut into uses. Members must issue the same collectives in the same order,
as with any backend.

**Reductions** add the members' rows in rank order (``rank_order_sum``), as zeropp's gloo
reduce-scatter does, so a reduce-scatter gives the same bits through either transport. An
all-reduce is two uses: every rank sums its slice of the rows into the other slot, then every
rank reads the whole result from there.
"""

from __future__ import annotations

import datetime
import mmap
import os
import secrets
import stat
import tempfile
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..watch import scratch_prefix
from .backend import control_all_reduce
from .plain import rank_order_sum
from .shm_sync import (
    BackendSync,
    FlagSync,
    ShmError,
    describe,
    flags_usable,
    header_bytes,
    peers_visible,
    publish_pid,
    read_pids,
)
from .stats import group_ranks

DEFAULT_REGION_BYTES = 32 << 20
"""The smallest region the engine asks for (and what the runner requires free under ``/dev/shm``):
it fits Docker's default 64 MB ``/dev/shm``."""

MAX_REGION_BYTES = 64 << 20
"""The largest region :func:`region_bytes_for` picks. The region's touched pages count in every
rank's resident set (shared, so the host holds them once); with the futex synchronisation a use
costs microseconds, so larger rows would buy little."""

SHM_DIR = "/dev/shm"
"""Where the region's file is created (and unlinked once every member mapped it)."""

_NAME_BYTES = 512  # the file's path, sent from group rank 0 as bytes
_TOKEN_BYTES = 8  # rank 0's random token, at the region's start and sent with the name


class ShmOp:
    """A collective issued on a :class:`ShmTransport`: :meth:`wait` before reading its output."""

    def __init__(self, transport: ShmTransport, last_use: int, finish: Optional[Callable[[], object]] = None) -> None:
        self._transport, self._last_use, self._finish, self.done = transport, last_use, finish, False

    def wait(self) -> None:
        if self.done:
            return
        self._transport.complete_through(self._last_use)
        self.done = True
        if self._finish is not None:
            self._finish()


class ShmTransport:
    """All-gather, reduce-scatter (sum) and all-reduce (sum) of plain CPU tensors over ``group``
    (None: the default group), through shared memory. Collective to construct; every member must be
    on this host and see the same ``directory``. ``timeout``: how long a member waits for a peer that
    is alive but does not reach the same collective (torch's default process-group timeout; a peer
    whose process ended is named at once)."""

    def __init__(
        self,
        group: Optional[dist.ProcessGroup] = None,
        *,
        region_bytes: Optional[int] = None,
        directory: Optional[str] = None,
        timeout: datetime.timedelta = dist.default_pg_timeout,
    ) -> None:
        self.group = group
        self.ranks = group_ranks(group)
        self.world = len(self.ranks)
        self.rank = self.ranks.index(dist.get_rank())
        W, head = self.world, header_bytes(self.world)
        if region_bytes is not None and _row_bytes(region_bytes - head, W) < 1024:
            raise ValueError(
                f"ShmTransport: region_bytes={region_bytes} leaves rows of under 1 KiB for {W} members; "
                f"pass at least {head + 2 * W * 1024}"
            )
        directory = SHM_DIR if directory is None else directory  # read at the call (tests point it elsewhere)
        self._mm: Optional[mmap.mmap]
        self._mm, region = _map_region(self.group, self.ranks, region_bytes, directory)
        self.row_bytes = _row_bytes(region.numel() - head, W)
        """Bytes of one member's row in a slot: a use moves at most this much per member."""
        self._slots = region[head : head + 2 * W * self.row_bytes].view(2, W, self.row_bytes)  # [2, W, R]
        # the counters in the header where every member can watch every peer's process, else the backend
        pids = read_pids(self._mm, W)
        cannot = torch.tensor([0 if flags_usable() and peers_visible(pids) else 1], dtype=torch.int64)
        control_all_reduce(cannot, "max", self.group)
        self._sync: Optional[FlagSync | BackendSync] = (
            BackendSync(group)
            if int(cannot)
            else FlagSync(
                self._mm,
                world=W,
                rank=self.rank,
                ranks=self.ranks,
                pids=[p for p, _ in pids],
                timeout_s=timeout.total_seconds(),
            )
        )
        self._issued = 0  # uses issued
        self._completed = 0  # uses whose synchronisation and read ran on this rank
        self._pending: Optional[Callable[[], None]] = None  # the last issued use's completion
        self._broken: Optional[BaseException] = None

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (the region is unmapped; no collective can run)."""
        return self._mm is None

    def close(self) -> None:
        """Unmap the region now (local, no collective; safe to call twice). The region's memory goes
        back to the host once every member closed it or exited, rather than when the cycle
        collector happens to run: a later transport in the same process (the next engine) finds
        the room again. A use still open is dropped unfinished; a collective after this raises."""
        if self._mm is None:
            return
        mm, self._mm = self._mm, None
        self._pending = None
        # every view of the mapping goes first: a buffer still exported would keep it mapped
        self._slots = torch.empty(0, dtype=torch.uint8)
        self._sync = None
        mm.close()

    # ------------------------------------------------------------------ uses
    def _slot(self, use: int, dtype: torch.dtype) -> torch.Tensor:
        return self._slots[use % 2].view(dtype)  # [W, R / element size]

    def _use(
        self,
        dtype: torch.dtype,
        desc: int,
        write: Callable[[torch.Tensor, torch.Tensor], object],
        read: Optional[Callable[[torch.Tensor], object]] = None,
    ) -> int:
        """One use, described by ``desc`` (``shm_sync.describe``: what every member must agree it
        is): complete the previous one, ``write(slot, previous slot)`` this rank's part, start the
        synchronisation; ``read(slot)`` runs when the use completes. Returns its number."""
        if self._sync is None:
            raise ShmError(
                "the shared-memory transport was closed (engine.close()); build a new engine to communicate again"
            )
        self.complete_through(self._issued)  # raises if an earlier use failed
        k = self._issued
        slot = self._slot(k, dtype)
        write(slot, self._slot(k - 1, dtype))
        synced = self._sync.start(k + 1, desc)

        def complete() -> None:
            synced()
            if read is not None:
                read(slot)

        self._pending = complete
        self._issued = k + 1
        return k + 1

    def complete_through(self, use: int) -> None:
        """Finish the uses up to number ``use`` (at most the last one is still open)."""
        if self._completed >= use:
            return
        if self._sync is None:
            raise ShmError("the shared-memory transport was closed (engine.close()) before this collective finished")
        if self._pending is None:  # a use up to ``use`` failed: its output was never read
            raise ShmError(
                f"the shared-memory transport failed earlier ({self._broken}); this collective did not finish and "
                f"the transport cannot be used again"
            )
        complete, self._pending = self._pending, None
        try:
            complete()
        except BaseException as exc:
            self._broken = exc
            raise
        self._completed = self._issued

    # ------------------------------------------------------------------ collectives
    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, within: Optional[range] = None) -> ShmOp:
        """``out`` ([W * S]) <- every member's ``shard`` ([S]), in member order.

        ``within``: a gather inside sub-groups of consecutive members that partition the group
        (hpZ's secondary groups): ``within`` is this rank's (member indices, its own among them),
        ``out`` ([len(within) * S]) receives those members' shards. Every member of the group makes
        the same call at the same point, each naming its own sub-group of the same size: one use of
        the region, each rank reading only its sub-group's rows."""
        W, me = self.world, self.rank
        rows = _sub_group_rows(within, W, me)  # the rows this rank reads
        M = rows.stop - rows.start
        src = _flat(shard, "all-gather input")  # [S]
        _check(out, shard, M * src.numel(), "all-gather")
        dst = out.view(M, -1)  # [M, S]
        cap = self.row_bytes // src.element_size()
        last = self._completed
        for a in range(0, src.numel(), cap):
            b = min(a + cap, src.numel())

            def write(slot: torch.Tensor, _prev: torch.Tensor, a: int = a, b: int = b) -> None:
                slot[me, : b - a].copy_(src[a:b])

            def read(slot: torch.Tensor, a: int = a, b: int = b) -> None:
                dst[:, a:b].copy_(slot[rows, : b - a])

            desc = describe("all_gather", src.dtype, src.numel(), a, b, *(() if within is None else ("within", M)))
            last = self._use(src.dtype, desc, write, read)
        return ShmOp(self, last)

    def reduce_scatter_sum(self, out: torch.Tensor, full: torch.Tensor) -> ShmOp:
        """``out`` ([S]) <- the sum over members of their ``full`` ([W * S]) chunk ``rank``, added in
        member order."""
        W, me = self.world, self.rank
        if not out.is_contiguous():
            raise ValueError("shared-memory reduce-scatter: the output must be contiguous (it is written in place)")
        dst, src = _flat(out, "reduce-scatter output"), full.reshape(W, -1)  # [S], [W, S]
        _check(full, out, W * dst.numel(), "reduce-scatter")
        cap = self.row_bytes // dst.element_size() // W
        last = self._completed
        for a in range(0, dst.numel(), cap):
            b = min(a + cap, dst.numel())
            c = b - a

            def write(slot: torch.Tensor, _prev: torch.Tensor, a: int = a, b: int = b, c: int = c) -> None:
                slot[me, : W * c].view(W, c).copy_(src[:, a:b])  # chunk j of every member's row: member j's

            def read(slot: torch.Tensor, a: int = a, b: int = b, c: int = c) -> None:
                rank_order_sum(slot[:, me * c : (me + 1) * c], dst[a:b])  # [W, c] rows -> [c]

            last = self._use(dst.dtype, describe("reduce_scatter", dst.dtype, dst.numel(), a, b), write, read)
        return ShmOp(self, last)

    def all_reduce_sum(self, t: torch.Tensor) -> ShmOp:
        """``t`` <- the sum over members of their ``t``, added in member order (in place)."""
        W, me = self.world, self.rank
        flat = _flat(t, "all-reduce tensor")  # [n]
        cap = self.row_bytes // flat.element_size()
        last = self._completed
        for a in range(0, flat.numel(), cap):
            b = min(a + cap, flat.numel())
            n = b - a
            lo, hi = me * n // W, (me + 1) * n // W  # this rank's slice of the chunk

            def write_row(slot: torch.Tensor, _prev: torch.Tensor, a: int = a, b: int = b) -> None:
                slot[me, : b - a].copy_(flat[a:b])

            def write_sum(slot: torch.Tensor, rows: torch.Tensor, lo: int = lo, hi: int = hi) -> None:
                rank_order_sum(rows[:, lo:hi], slot.view(-1)[lo:hi])  # [W, hi - lo] -> the result's slice

            def read(slot: torch.Tensor, a: int = a, b: int = b) -> None:
                flat[a:b].copy_(slot.view(-1)[: b - a])

            desc = describe("all_reduce", flat.dtype, flat.numel(), a, b)
            self._use(flat.dtype, desc, write_row)
            last = self._use(flat.dtype, desc, write_sum, read)
        return ShmOp(self, last, None if flat is t else (lambda: t.copy_(flat.view_as(t))))


def region_bytes_for(free: int) -> int:
    """The region's size given ``free`` bytes under its directory: an eighth of them, at least
    :data:`DEFAULT_REGION_BYTES` and at most :data:`MAX_REGION_BYTES`. The region is allocated
    whole at set-up (``posix_fallocate``: a ``/dev/shm`` that fills later cannot kill a rank with
    SIGBUS mid-write) and holds host memory, once for the host, until the ranks exit."""
    return max(DEFAULT_REGION_BYTES, min(MAX_REGION_BYTES, free // 8 // (1 << 20) << 20))


def _row_bytes(region_bytes: int, world: int) -> int:
    return region_bytes // (2 * world) // 64 * 64  # a multiple of every dtype's element size


def _sub_group_rows(within: Optional[range], world: int, me: int) -> slice:
    """The slot rows a gather reads: all ``world`` members, or the sub-group ``within`` (consecutive
    member indices that include this rank's ``me``)."""
    if within is None:
        return slice(0, world)
    if within.step != 1 or not 0 <= within.start < within.stop <= world or me not in within:
        raise ValueError(
            f"shared-memory all-gather: within={within!r} must be consecutive member indices of this group of "
            f"{world} that include this rank's {me}"
        )
    return slice(within.start, within.stop)


def _flat(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.device.type != "cpu":
        raise ValueError(f"the shared-memory transport moves CPU tensors; the {what} is on {t.device}")
    return t.view(-1) if t.is_contiguous() else t.reshape(-1).clone()


def _check(big: torch.Tensor, small: torch.Tensor, want: int, what: str) -> None:
    if big.numel() != want or big.dtype != small.dtype:
        raise ValueError(
            f"shared-memory {what}: the full tensor must hold {want} elements of {small.dtype}; "
            f"got {big.numel()} of {big.dtype}"
        )
    if not big.is_contiguous():
        raise ValueError(f"shared-memory {what}: the full tensor must be contiguous")


# ---------------------------------------------------------------------- the region
def _map_region(
    group: Optional[dist.ProcessGroup], ranks: list[int], nbytes: Optional[int], directory: str
) -> tuple[mmap.mmap, torch.Tensor]:
    """Create (group rank 0; ``nbytes`` None: :func:`region_bytes_for` its free space), open, check
    and map the region; unlinked before returning."""
    me = dist.get_rank()
    src = ranks[0]
    # [path bytes | token | size]: the size as 8 little-endian bytes
    msg = torch.zeros(_NAME_BYTES + _TOKEN_BYTES + 8, dtype=torch.uint8)
    path, fd, problem = "", -1, ""
    if me == src:
        try:
            if nbytes is None:
                st = os.statvfs(directory)
                nbytes = region_bytes_for(st.f_bavail * st.f_frsize)
            fd, path = tempfile.mkstemp(prefix=scratch_prefix(directory, "shm", me), dir=directory)
            os.ftruncate(fd, nbytes)
            if hasattr(os, "posix_fallocate"):  # the pages now: a tmpfs filled later would SIGBUS a write
                os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            size = f"a {nbytes >> 20} MiB file" if nbytes else "a file"
            problem = f"rank {me} could not create {size} in {directory}: {exc.strerror or exc}"
        token = secrets.token_bytes(_TOKEN_BYTES)
        raw = path.encode()
        if not problem and len(raw) >= _NAME_BYTES:
            problem = f"the region's path {path!r} is longer than {_NAME_BYTES - 1} bytes"
        if not problem and nbytes is not None:
            msg[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            msg[_NAME_BYTES : _NAME_BYTES + _TOKEN_BYTES] = torch.frombuffer(bytearray(token), dtype=torch.uint8)
            msg[_NAME_BYTES + _TOKEN_BYTES :] = torch.frombuffer(
                bytearray(nbytes.to_bytes(8, "little")), dtype=torch.uint8
            )
        else:  # no path, but why: every member's error names rank 0's cause
            why = problem.encode()[: _NAME_BYTES - 2]
            msg[1 : 1 + len(why)] = torch.frombuffer(bytearray(why), dtype=torch.uint8)
    try:
        dist.broadcast(msg, src, group=group)
        nbytes = int.from_bytes(bytes(msg[_NAME_BYTES + _TOKEN_BYTES :].tolist()), "little")
        if me != src:
            text = bytes(msg[:_NAME_BYTES].tolist()).rstrip(b"\0")
            if text[:1] not in (b"", b"\0"):
                path = text.decode(errors="replace")
                fd, problem = _open_checked(path, nbytes)
            else:  # rank 0's reason after a zero byte
                problem = text[1:].decode(errors="replace") or f"rank {src} could not create the region"
        mm = None
        if not problem:
            try:
                mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except (OSError, ValueError) as exc:
                problem = f"rank {me} could not map {path}: {exc}"
        if fd >= 0:
            os.close(fd)
        region = torch.frombuffer(mm, dtype=torch.uint8) if mm is not None else torch.empty(0, dtype=torch.uint8)
        if mm is not None:
            publish_pid(mm, len(ranks), ranks.index(me))
        token_sent = msg[_NAME_BYTES : _NAME_BYTES + _TOKEN_BYTES]
        if me == src and mm is not None:
            region[:_TOKEN_BYTES].copy_(token_sent)
        _agree(problem, group, directory)  # every member mapped it (or every member raises)
        if me != src and not torch.equal(region[:_TOKEN_BYTES], token_sent):
            problem = f"rank {me} maps {path} but not rank {src}'s memory (another host, container or {directory})"
        _agree(problem, group, directory)
    finally:
        if me == src and path:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    assert mm is not None
    return mm, region


def _open_checked(path: str, nbytes: int) -> tuple[int, str]:
    """Open rank 0's file without following a link; a regular file of this user of ``nbytes``."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        return -1, f"rank {dist.get_rank()} could not open {path}: {exc.strerror or exc}"
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size != nbytes:
        os.close(fd)
        return -1, f"rank {dist.get_rank()} found {path} is not the {nbytes}-byte region rank 0 created"
    return fd, ""


def _agree(problem: str, group: Optional[dist.ProcessGroup], directory: str) -> None:
    """Raise on every member when any member has a problem, naming the first such member's problem
    on every member (one more exchange, on that path only)."""
    ranks = group_ranks(group)
    first = torch.tensor([len(ranks) - ranks.index(dist.get_rank()) if problem else 0], dtype=torch.int64)
    control_all_reduce(first, "max", group)  # len(ranks) - the lowest member index with a problem
    if int(first) == 0:
        return
    src = ranks[len(ranks) - int(first)]
    text = torch.zeros(_NAME_BYTES, dtype=torch.uint8)
    if dist.get_rank() == src:
        raw = problem.encode()[:_NAME_BYTES]
        text[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    dist.broadcast(text, src, group=group)
    reason = bytes(text.tolist()).rstrip(b"\0").decode(errors="replace")
    raise ShmError(
        f"zero.transport=shm: {reason}; every rank of the ZeRO group must share {directory} on one host "
        f"with room for the region (use zero.transport=backend otherwise)",
        cause=reason,
    )
