"""What a launched rank tells the launcher watching it: heartbeats, and the scratch it leaves.

:func:`zeropp.experiments.launch.launch_world` gives every rank a private *world directory* (env
:data:`WORLD_DIR_ENV`, a fresh ``mkdtemp`` of the launcher, removed when the world ends) and a run id
(:data:`RUN_ID_ENV`, random): :func:`open_world` makes both, :func:`close_world` cleans up. Through that directory a rank publishes two things, both plain JSON
files (data, never code), and the launcher reads them. Under ``torchrun`` (or any other
launcher) neither variable is set: :func:`heartbeat` does nothing and scratch names carry no run id;
the torchrun agent has its own health check, and nothing of ours watches those ranks.

Heartbeats (who is silent). A rank has two kinds of life, and a stopped or stuck rank loses one of
them while its waiting peers keep both:

- *alive*: a daemon thread, started by the first :func:`heartbeat` call (or :func:`start` for
  function ranks), rewrites ``heartbeat.<rank>`` every tick (``ZEROPP_HEARTBEAT_TICK_S``, a tenth
  of the deadline, at most 1 s) and soon after each beat, with an increasing ``tick``. A process
  that is SIGSTOPped (Ctrl-Z, a debugger) or frozen has all its threads stopped, so its tick
  stops; a rank waiting in a collective for a slow peer keeps ticking.
- *progress*: the main thread calls :func:`heartbeat` (``phase``, ``step``) at points where it
  makes progress; the call only updates a counter in memory and wakes the daemon, which publishes
  at most every :data:`MIN_PUBLISH_S`, so it is cheap enough for every micro-step. Each call is a
  *beat*. The daemon also publishes where the beating thread is now (file:line in function, from
  ``sys._current_frames``), so a stuck rank is reported with the line it is stuck on.

The launcher's rule (:func:`judge`, evaluated by :class:`HeartbeatMonitor` every half second over
the ranks still running; "for N s" is measured on the launcher's clock from the last *change* it
saw, so no clocks are compared across processes):

1. *stopped*: a rank whose tick has not changed for ``deadline_s`` is named, whatever the others
   do (its process is stopped or frozen: only that stops every thread). This holds through long
   phases too. The message says which, from the process state in ``/proc``: stopped (``T``), or
   alive with a silent heartbeat thread (a native call holding the interpreter lock, or a
   heartbeat file that cannot be written).
2. *stuck*: otherwise, a rank whose beats have not changed for ``deadline_s`` is named when it is
   *behind*: it has the fewest beats, and at least one other running rank has more (it went past
   the point where this one stopped, and now waits for it in a collective, or carries on). Beats
   are placed on code paths every rank takes in the same order (like collectives), so equal
   counts mean "at the same point": when every running rank is silent at the same count (all in
   one collective, or all in one slow step) nobody is named, and the collective timeout
   (``launcher.pg_timeout_s``) judges a real communication stall. A lone running rank is never
   named by this rule (nothing tells its slow work from a deadlock).
3. A phase announced ``long=True`` (model creation, the first step's kernel builds, a checkpoint
   save or load) exempts its rank from rule 2 until its next beat; rule 1 still applies.

A rank is watched from its first published heartbeat (before that it may still be importing);
while any running rank has none yet, rule 2 waits. If the launcher itself was not scheduled for
half a deadline, it starts its clocks afresh rather than judge a span it did not watch.

Why by hand: torch's elastic agent watches exit codes only, and its NCCL watchdog times out
collectives (blaming the waiting rank, as the gloo timeout does); a heartbeat in the rendezvous
store would stall with the rank hosting the store. Files in a directory only the launcher and its
ranks know need no server, and a stopped rank cannot block the reader.

Scratch (what a rank leaves behind). A rank that creates a directory which must not outlive the
run (the nvme tier's swap files, as large as the model state) takes its name from
:func:`scratch_prefix`, which puts the run id in the name and first records ``(root, prefix)`` in
``scratch.<rank>``. After the world ends, whatever happened to the ranks (a SIGKILLed rank cannot
clean up), :func:`remove_scratch` removes every directory ``root/prefix*`` recorded for the run:
only names carrying this run's id, never a symlink, so another run sharing the same root keeps
its own. Recording before creating leaves no window in which a killed rank's directory is unknown.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Callable, Sequence

WORLD_DIR_ENV = "ZEROPP_WORLD_DIR"
"""The launcher's private directory of this world (heartbeats, scratch records)."""
RUN_ID_ENV = "ZEROPP_RUN_ID"
"""A random id of this world, part of every scratch directory name."""
TICK_ENV = "ZEROPP_HEARTBEAT_TICK_S"
"""Seconds between published heartbeats; set only when the launcher watches heartbeats."""
MIN_PUBLISH_S = 0.05
"""Shortest time between two publications of a rank (beats in between are published together)."""

# ---------------------------------------------------------------------------------- rank side


def run_id() -> str | None:
    """This world's run id, or None when no zeropp launcher started this process."""
    return os.environ.get(RUN_ID_ENV) or None


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def scratch_prefix(root: str | os.PathLike, kind: str, rank: int) -> str:
    """The ``mkdtemp`` prefix of a scratch directory of this rank under ``root``:
    ``zeropp-<kind>-<run id>-r<rank>-`` (``zeropp-<kind>-r<rank>-`` without a launcher), after
    recording ``(root, prefix)`` so the launcher removes ``root/prefix*`` when the world ends."""
    rid = run_id()
    prefix = f"zeropp-{kind}-{rid}-r{rank}-" if rid else f"zeropp-{kind}-r{rank}-"
    world = os.environ.get(WORLD_DIR_ENV)
    if rid and world:
        line = json.dumps({"root": os.path.abspath(os.fspath(root)), "prefix": prefix}) + "\n"
        fd = os.open(os.path.join(world, f"scratch.{_rank()}"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    return prefix


class _Publisher(threading.Thread):
    """The daemon that rewrites ``heartbeat.<rank>`` every tick with the latest beat."""

    def __init__(self, directory: str, rank: int, tick_s: float) -> None:
        super().__init__(name="zeropp-heartbeat", daemon=True)
        self.path = os.path.join(directory, f"heartbeat.{rank}")
        self.tick_s = tick_s
        self.wake = threading.Event()
        self.ticks = 0
        self.lock = threading.Lock()  # the daemon and flush() may publish at the same time
        self.state: tuple[int, str, int | None, bool, int | None] = (0, "start", None, False, None)
        """(beats, phase, step, long, id of the beating thread), replaced whole by each beat."""

    def beat(self, phase: str, step: int | None, long: bool) -> None:
        self.state = (self.state[0] + 1, phase, step, long, threading.get_ident())
        self.wake.set()

    def _where(self, ident: int | None) -> str:
        frame = sys._current_frames().get(ident) if ident is not None else None
        while frame is not None and frame.f_code.co_filename == __file__:  # flush() from the beating thread
            frame = frame.f_back
        if frame is None:
            return ""
        code = frame.f_code
        return f"{'/'.join(Path(code.co_filename).parts[-2:])}:{frame.f_lineno} in {code.co_name}"

    def publish(self) -> None:
        with self.lock:
            beats, phase, step, long, ident = self.state
            self.ticks += 1
            record = {
                "pid": os.getpid(),
                "tick": self.ticks,
                "beats": beats,
                "phase": phase,
                "step": step,
                "long": long,
                "where": self._where(ident),
            }
            tmp = f"{self.path}.tmp"
            with open(tmp, "w") as f:
                f.write(json.dumps(record))
            os.replace(tmp, self.path)  # the launcher reads the old record or the new one, never half

    def run(self) -> None:
        while True:
            self.wake.clear()
            with contextlib.suppress(OSError):  # a transient write error: the next tick retries
                self.publish()
            time.sleep(MIN_PUBLISH_S)
            self.wake.wait(max(self.tick_s - MIN_PUBLISH_S, 0.0))


_publisher: _Publisher | None = None
_unwatched = False  # no watching launcher: heartbeat() returns at once
_lock = threading.Lock()


def start() -> bool:
    """Start publishing this rank's heartbeat if a watching launcher asked for it (idempotent);
    True if it is published."""
    global _publisher, _unwatched
    with _lock:
        if _publisher is None:
            world, tick = os.environ.get(WORLD_DIR_ENV), os.environ.get(TICK_ENV)
            if not (world and tick):
                _unwatched = True
                return False
            _publisher = _Publisher(world, _rank(), float(tick))
            flush()  # the first record, before the daemon's first tick
            _publisher.start()
        return True


def heartbeat(phase: str, step: int | None = None, *, long: bool = False) -> None:
    """Mark progress of this rank: it reached ``phase`` (of ``step``). ``long=True`` announces a
    phase that may legitimately outlast the launcher's deadline (model creation, the first step's
    kernel builds, a checkpoint save); until the next call the rank is only checked for being
    alive. Call it on code paths every rank takes in the same order (see the module docstring).
    Does nothing unless a watching launcher started this process."""
    if _publisher is None and (_unwatched or not start()):
        return
    assert _publisher is not None
    _publisher.beat(phase, step, long)


def flush() -> None:
    """Publish this rank's latest beat now, from the calling thread. The daemon publishes a beat
    within :data:`MIN_PUBLISH_S` when it gets the CPU, which a loaded machine may delay past the
    rank's next action; call this before an action that stops every thread (a self-inflicted
    SIGSTOP, ``os.abort``), so the launcher's "last seen" is that beat. Does nothing unwatched."""
    if _publisher is not None:
        with contextlib.suppress(OSError):  # a heartbeat never fails the rank
            _publisher.publish()


# ---------------------------------------------------------------------------------- launcher side


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankView:
    """What the launcher knows of one running rank's heartbeat."""

    rank: int
    """The rank."""
    silent_s: float
    """Seconds since its tick (its daemon thread) last changed."""
    idle_s: float
    """Seconds since its beats (its main thread's progress) last changed."""
    beats: int
    """Progress marks so far."""
    phase: str = ""
    """Phase of its last beat."""
    step: int | None = None
    """Step of its last beat, if it gave one."""
    long: bool = False
    """Its last beat announced a long phase (rule 2 does not apply)."""
    where: str = ""
    """Where its beating thread was at the last tick (file:line in function)."""
    state: str = ""
    """Its process state from ``/proc`` (e.g. ``T (stopped)``), filled in for rule 1's message."""

    def last_seen(self) -> str:
        parts = ([f"step {self.step}"] if self.step is not None else []) + [f"phase {self.phase}"]
        return ", ".join(parts) + (f", at {self.where}" if self.where else "")


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A rank the launcher names as silent, and the message saying why."""

    rank: int
    message: str


def judge(views: Sequence[RankView], deadline_s: float, *, all_seen: bool = True) -> Verdict | None:
    """The silent rank among the running ranks ``views`` (rules 1-3 of the module docstring), or
    None. ``all_seen=False``: some running rank has not published yet (rule 2 waits)."""
    stopped = [v for v in views if v.silent_s > deadline_s]
    if stopped:
        v = max(stopped, key=lambda v: (v.silent_s, -v.rank))
        if v.state and v.state[0] not in "Tt":  # running or sleeping: only the heartbeat thread is silent
            why = (
                f"its process is alive (state {v.state}) but its heartbeat thread is silent: a native call holds "
                "Python's interpreter lock that long, or the heartbeat file cannot be written (a full disk under "
                "the run directory?)"
            )
        else:
            state = f"is not running (state {v.state})" if v.state else "stopped responding"
            why = f"its process {state}: it was stopped (SIGSTOP, Ctrl-Z, a debugger) or is frozen"
        return Verdict(
            v.rank,
            f"rank {v.rank} made no progress for {v.silent_s:.0f} s (last seen: {v.last_seen()}); "
            f"{why}; stopped all ranks",
        )
    if not all_seen or len(views) < 2:
        return None
    lo = min(v.beats for v in views)
    ahead = sorted(v.rank for v in views if v.beats > lo)
    stuck = sorted(
        (v for v in views if v.beats == lo and not v.long and v.idle_s > deadline_s), key=lambda v: (-v.idle_s, v.rank)
    )
    if not ahead or not stuck:
        return None
    v = stuck[0]
    also = f" (also silent: ranks {sorted(s.rank for s in stuck[1:])})" if len(stuck) > 1 else ""
    return Verdict(
        v.rank,
        f"rank {v.rank} made no progress for {v.idle_s:.0f} s (last seen: {v.last_seen()}) "
        f"while ranks {ahead} went past that point{also}; it is deadlocked or stuck in I/O; "
        "stopped all ranks",
    )


def _proc_state(pid: int) -> str:
    """``T (stopped)`` etc. from ``/proc/<pid>/status``; empty where unavailable."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("State:"):
                return line.split(":", 1)[1].strip()
    return ""


@dataclasses.dataclass
class _Seen:
    tick: int
    beats: int
    t_tick: float
    t_beat: float
    record: dict


class HeartbeatMonitor:
    """The launcher's side: reads ``heartbeat.<rank>`` of the running ranks and applies
    :func:`judge`. ``clock`` is injectable for tests."""

    def __init__(
        self, directory: str | os.PathLike, deadline_s: float, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if deadline_s <= 0:
            raise ValueError(f"heartbeat deadline must be > 0 s, got {deadline_s}")
        self.directory = Path(directory)
        self.deadline_s = deadline_s
        self.clock = clock
        self.seen: dict[int, _Seen] = {}
        self._last = clock()

    @staticmethod
    def tick_s(deadline_s: float) -> float:
        """The publishing period the ranks are given: a tenth of the deadline, at most 1 s."""
        return min(1.0, deadline_s / 10)

    def _read(self, rank: int) -> dict | None:
        with contextlib.suppress(OSError, ValueError):
            rec = json.loads((self.directory / f"heartbeat.{rank}").read_text())
            if isinstance(rec, dict) and isinstance(rec.get("tick"), int) and isinstance(rec.get("beats"), int):
                return rec
        return None

    def check(self, running: Sequence[int]) -> Verdict | None:
        """Read the running ranks' heartbeats; the verdict, if one of them is silent."""
        now = self.clock()
        if now - self._last > self.deadline_s / 2:  # we were not watching: do not judge that span
            for seen in self.seen.values():
                seen.t_tick = seen.t_beat = now
        self._last = now
        views = []
        for r in running:
            rec = self._read(r)
            s = self.seen.get(r)
            if rec is not None:
                if s is None:
                    s = self.seen[r] = _Seen(rec["tick"], rec["beats"], now, now, rec)
                if rec["tick"] != s.tick:
                    s.tick, s.t_tick = rec["tick"], now
                if rec["beats"] != s.beats:
                    s.beats, s.t_beat = rec["beats"], now
                s.record = rec
            if s is not None:
                rec, silent = s.record, now - s.t_tick
                state = _proc_state(int(rec.get("pid", 0))) if silent > self.deadline_s and rec.get("pid") else ""
                views.append(
                    RankView(
                        rank=r,
                        silent_s=silent,
                        idle_s=now - s.t_beat,
                        beats=s.beats,
                        phase=str(rec.get("phase", "")),
                        step=rec.get("step"),
                        long=bool(rec.get("long")),
                        where=str(rec.get("where", "")),
                        state=state,
                    )
                )
        return judge(views, self.deadline_s, all_seen=len(views) == len(running))


def open_world(parent: str | os.PathLike | None, heartbeat_s: float | None) -> tuple[str, str, dict[str, str]]:
    """A new world: its private directory (``mkdtemp`` in ``parent``, else the temporary
    directory), a random run id, and the environment that gives both to its ranks (and the
    heartbeat tick when ``heartbeat_s`` is set: the ranks then publish). :func:`close_world` ends it."""
    rid = secrets.token_hex(6)
    world_dir = tempfile.mkdtemp(prefix=f"zeropp-world-{rid}-", dir=parent)
    env = {WORLD_DIR_ENV: world_dir, RUN_ID_ENV: rid}
    if heartbeat_s:
        env[TICK_ENV] = str(HeartbeatMonitor.tick_s(heartbeat_s))
    return world_dir, rid, env


def close_world(world_dir: str, rid: str) -> None:
    """After every rank of the world is gone: remove the scratch they recorded
    (:func:`remove_scratch`) and the world's directory; what could not be removed is named in a
    warning (never an error: the world's own outcome is what the caller reports)."""
    try:
        _, problems = remove_scratch(world_dir, rid)
    finally:
        shutil.rmtree(world_dir, ignore_errors=True)
    for p in problems:
        warnings.warn(f"run {rid}: {p}", RuntimeWarning, stacklevel=3)


def remove_scratch(world_dir: str | os.PathLike, rid: str) -> tuple[list[str], list[str]]:
    """Remove every directory (or file: the shared-memory region, ``zeropp.comm.shm``) recorded by
    :func:`scratch_prefix` in ``world_dir`` for run ``rid``;
    ``(removed, problems)``. Records whose prefix lacks the run id (or is a path) are refused and
    named in ``problems``, as are roots that could not be listed and directories that could not be
    removed: it never raises, since the launcher calls it while a rank's failure may be on its way
    to the user."""
    removed: list[str] = []
    problems: list[str] = []
    for rec_file in sorted(Path(world_dir).glob("scratch.*")):
        try:
            lines = rec_file.read_text(errors="replace").splitlines()
        except OSError as e:
            problems.append(f"could not read {rec_file}: {e}")
            continue
        for line in lines:
            try:
                rec = json.loads(line)
                root, prefix = str(rec["root"]), str(rec["prefix"])
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a killed rank: its directory was never created
            if f"-{rid}-" not in prefix or os.sep in prefix or not os.path.isabs(root):
                problems.append(
                    f"{rec_file.name}: refused to clean {root!r} / {prefix!r}: not a scratch name of run {rid}"
                )
                continue
            try:
                entries = list(os.scandir(root))
            except FileNotFoundError:
                continue  # the root went away, and its scratch with it
            except OSError as e:  # not a directory any more, or no longer ours to list
                problems.append(f"could not look for {prefix}* in {root}: {e}")
                continue
            for entry in entries:
                if not entry.name.startswith(prefix):
                    continue
                directory = entry.is_dir(follow_symlinks=False)
                if directory or entry.is_file(follow_symlinks=False):
                    try:
                        if directory:
                            shutil.rmtree(entry.path)
                        else:
                            os.unlink(entry.path)
                        removed.append(entry.path)
                    except OSError as e:
                        problems.append(f"could not remove {entry.path}: {e}")
    return removed, problems


__all__: Sequence[str] = (
    "RUN_ID_ENV",
    "TICK_ENV",
    "WORLD_DIR_ENV",
    "HeartbeatMonitor",
    "RankView",
    "Verdict",
    "close_world",
    "flush",
    "heartbeat",
    "judge",
    "open_world",
    "remove_scratch",
    "run_id",
    "scratch_prefix",
    "start",
)
