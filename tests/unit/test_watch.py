"""The rank <-> launcher channel (zeropp/watch.py) without processes: the silent-rank rule on fake
heartbeats, the monitor reading heartbeat files on a fake clock, and the removal of recorded
scratch directories (only this run's; a crafted record cannot make it delete anything else).
The same paths with real ranks (SIGSTOP, a hung main thread, SIGKILL) are in test_harness.py and
test_experiments_e2e.py.

Here: the one-process checks of this topic; its other tiers' checks are in
``tests/distributed/test_watch.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from zeropp import watch
from zeropp.watch import HeartbeatMonitor, RankView, judge, remove_scratch

D = 20.0  # the deadline of these tests


def _v(
    rank: int,
    *,
    silent: float = 0.5,
    idle: float = 0.5,
    beats: int = 10,
    long: bool = False,
    step: int | None = 7,
    phase: str = "train_step",
) -> RankView:
    return RankView(
        rank=rank,
        silent_s=silent,
        idle_s=idle,
        beats=beats,
        long=long,
        step=step,
        phase=phase,
        where="experiments/runner/worker.py:200 in _train",
    )


# ---------------------------------------------------------------- the rule


def test_everyone_busy_or_recent_is_fine():
    assert judge([_v(0), _v(1), _v(2)], D) is None
    assert judge([_v(0, idle=D - 1), _v(1, idle=D - 1, beats=9)], D) is None  # behind, but not for long


def test_a_stopped_process_is_named_whatever_the_others_do():
    v = judge([_v(0, idle=30), _v(1, silent=21, idle=21), _v(2, idle=30)], D)
    assert v is not None and v.rank == 1
    assert v.message.startswith(
        "rank 1 made no progress for 21 s (last seen: step 7, phase train_step, at "
        "experiments/runner/worker.py:200 in _train); its process stopped responding"
    )
    assert "stopped all ranks" in v.message
    # a long phase does not shield a stopped process; the one silent longest is named
    v = judge([_v(0, silent=25, long=True), _v(1, silent=22)], D)
    assert v is not None and v.rank == 0
    state = RankView(rank=3, silent_s=30, idle_s=30, beats=1, state="T (stopped)")
    assert "its process is not running (state T (stopped)): it was stopped" in judge([state], D).message  # type: ignore[union-attr]
    # a process that runs but whose heartbeat thread cannot publish is not called stopped
    alive = dataclasses.replace(state, state="S (sleeping)")
    msg = judge([alive], D).message  # type: ignore[union-attr]
    assert "its process is alive (state S (sleeping)) but its heartbeat thread is silent" in msg, msg
    assert "not running" not in msg and "SIGSTOP" not in msg and msg.endswith("; stopped all ranks"), msg


def test_the_rank_behind_the_waiting_ones_is_named():
    # rank 2 stopped beating at 9 while ranks 0, 1, 3 went on to 10 and now wait in a collective
    views = [_v(0, idle=25), _v(1, idle=25), _v(2, beats=9, idle=26, step=6, phase="step_end"), _v(3, idle=24)]
    v = judge(views, D)
    assert v is not None and v.rank == 2
    assert v.message.startswith("rank 2 made no progress for 26 s (last seen: step 6, phase step_end")
    assert "while ranks [0, 1, 3] went past that point" in v.message and "deadlocked" in v.message
    # the others need not be silent: they may carry on without it
    assert judge([_v(0, idle=1, beats=30), _v(1, beats=9, idle=21)], D).rank == 1  # type: ignore[union-attr]


def test_ranks_at_the_same_point_are_left_to_the_collective_timeout():
    # all silent at the same beat: one collective (or one slow step) holds them all
    assert judge([_v(0, idle=100), _v(1, idle=100), _v(2, idle=100)], D) is None
    # a lone running rank is never named for slow progress
    assert judge([_v(0, idle=100)], D) is None


def test_a_long_phase_is_exempt_from_the_progress_rule():
    # rank 0 saves a checkpoint (announced long) while rank 1 finished its part and waits
    assert judge([_v(0, beats=9, idle=100, long=True), _v(1, idle=100)], D) is None
    # several ranks behind: the silent ones not in a long phase are named, the longest first
    v = judge([_v(0, beats=9, idle=40, long=True), _v(1, beats=9, idle=30), _v(2, beats=9, idle=35), _v(3)], D)
    assert v is not None and v.rank == 2 and "(also silent: ranks [1])" in v.message


def test_progress_waits_until_every_running_rank_has_published():
    views = [_v(0, idle=100), _v(1, beats=9, idle=100)]
    assert judge(views, D, all_seen=False) is None
    assert judge(views, D).rank == 1  # type: ignore[union-attr]
    assert judge([_v(0, silent=100)], D, all_seen=False).rank == 0  # type: ignore[union-attr]  # rule 1 does not wait


# ---------------------------------------------------------------- the monitor on files


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _publish(d: Path, rank: int, tick: int, beats: int, **extra) -> None:
    rec = {
        "pid": 0,
        "tick": tick,
        "beats": beats,
        "phase": "train_step",
        "step": beats,
        "long": False,
        "where": "",
        **extra,
    }
    (d / f"heartbeat.{rank}").write_text(json.dumps(rec))


def _advance(mon: HeartbeatMonitor, clock: _Clock, seconds: float, running: list[int], every=None):
    """Step the fake clock in polls of 0.5 s (as the launcher does) calling ``every`` before each."""
    verdict = None
    for _ in range(int(seconds / 0.5)):
        clock.t += 0.5
        if every:
            every()
        verdict = mon.check(running)
        if verdict:
            return verdict
    return verdict


def test_monitor_names_a_rank_whose_ticks_stop(tmp_path: Path):
    clock = _Clock()
    mon = HeartbeatMonitor(tmp_path, 5.0, clock=clock)
    n = {"t": 0}

    def beat() -> None:  # rank 0 ticks on; rank 1 froze at tick 3
        n["t"] += 1
        _publish(tmp_path, 0, n["t"], 4)

    _publish(tmp_path, 1, 3, 4)
    assert mon.check([0, 1]) is None
    v = _advance(mon, clock, 10, [0, 1], beat)
    assert v is not None and v.rank == 1 and v.message.startswith("rank 1 made no progress for 6 s (last seen: step 4")
    assert clock.t - 1000.0 == 5.5  # named at the first poll past the deadline


def test_monitor_ignores_torn_or_missing_files_and_spans_it_did_not_watch(tmp_path: Path):
    clock = _Clock()
    mon = HeartbeatMonitor(tmp_path, 5.0, clock=clock)
    assert mon.check([0, 1]) is None  # nothing published yet: not judged
    _publish(tmp_path, 0, 1, 5)
    _publish(tmp_path, 1, 1, 4)
    mon.check([0, 1])
    (tmp_path / "heartbeat.1").write_text('{"tick": 2, "bea')  # a torn write (never happens with replace)
    clock.t += 0.5
    assert mon.check([0, 1]) is None and mon.seen[1].tick == 1
    clock.t += 60  # the launcher was not scheduled for a minute: it starts its clocks afresh
    assert mon.check([0, 1]) is None
    v = _advance(mon, clock, 10, [0, 1], lambda: _publish(tmp_path, 0, int(clock.t * 2), 5))
    assert v is not None and v.rank == 1 and "stopped responding" in v.message  # only after a watched deadline


def test_monitor_names_the_rank_behind_by_its_beats(tmp_path: Path):
    clock = _Clock()
    mon = HeartbeatMonitor(tmp_path, 5.0, clock=clock)

    def tick() -> None:  # both alive; rank 0 beat once more and waits, rank 1 is stuck
        t = int(clock.t * 2)
        _publish(tmp_path, 0, t, 8)
        _publish(tmp_path, 1, t, 7, phase="step_end", where="experiments/runner/worker.py:65 in _maybe_fault")

    tick()
    v = _advance(mon, clock, 10, [0, 1], tick)
    assert v is not None and v.rank == 1
    assert "(last seen: step 7, phase step_end, at experiments/runner/worker.py:65 in _maybe_fault)" in v.message
    assert "while ranks [0] went past that point" in v.message
    assert _advance(mon, clock, 10, [1], tick) is None  # rank 0 finished: a lone rank is not judged on progress


def test_deadline_must_be_positive(tmp_path: Path):
    with pytest.raises(ValueError, match="> 0"):
        HeartbeatMonitor(tmp_path, 0)
    assert HeartbeatMonitor.tick_s(20) == 1.0 and HeartbeatMonitor.tick_s(5) == 0.5


# ---------------------------------------------------------------- scratch


def _record(world: Path, rank: int, root: Path | str, prefix: str) -> None:
    with open(world / f"scratch.{rank}", "a") as f:
        f.write(json.dumps({"root": str(root), "prefix": prefix}) + "\n")


def test_scratch_prefix_records_before_creating(tmp_path: Path, monkeypatch):
    world, root = tmp_path / "world", tmp_path / "nvme"
    world.mkdir()
    root.mkdir()
    monkeypatch.delenv(watch.RUN_ID_ENV, raising=False)
    assert watch.scratch_prefix(root, "swap", 3) == "zeropp-swap-r3-"  # no launcher: no record
    monkeypatch.setenv(watch.RUN_ID_ENV, "abc123def456")
    monkeypatch.setenv(watch.WORLD_DIR_ENV, str(world))
    monkeypatch.setenv("RANK", "3")
    assert watch.scratch_prefix(root, "swap", 3) == "zeropp-swap-abc123def456-r3-"
    rec = json.loads((world / "scratch.3").read_text())
    assert rec == {"root": str(root), "prefix": "zeropp-swap-abc123def456-r3-"}


def test_remove_scratch_removes_only_this_runs_directories(tmp_path: Path):
    world, root, elsewhere = tmp_path / "world", tmp_path / "nvme", tmp_path / "precious"
    for d in (world, root, elsewhere):
        d.mkdir()
    rid = "abc123def456"
    mine = [root / f"zeropp-swap-{rid}-r0-x1", root / f"zeropp-swap-{rid}-r1-y2"]
    for d in mine:
        (d / "sub").mkdir(parents=True)
        (d / "sub" / "opt.swp").write_bytes(b"x" * 100)
    other = root / "zeropp-swap-0123456789ab-r0-z3"  # another run sharing nvme_path
    other.mkdir()
    (elsewhere / "data").write_text("keep")
    link = root / f"zeropp-swap-{rid}-r1-link"  # a symlink with our name: never followed
    link.symlink_to(elsewhere)
    _record(world, 0, root, f"zeropp-swap-{rid}-r0-")
    _record(world, 1, root, f"zeropp-swap-{rid}-r1-")
    _record(world, 1, elsewhere.parent, "precious")  # crafted: no run id
    _record(world, 1, "relative", f"zeropp-swap-{rid}-r1-")  # crafted: relative root
    _record(world, 1, root, f"../precious/zeropp-swap-{rid}-")  # crafted: a path
    with open(world / "scratch.1", "a") as f:
        f.write('{"root": "/", "pre')  # a line cut short by a SIGKILL
    removed, problems = remove_scratch(world, rid)
    assert sorted(removed) == sorted(map(str, mine))
    assert sorted(os.listdir(root)) == sorted([other.name, link.name])
    assert (elsewhere / "data").read_text() == "keep"
    assert len(problems) == 3 and all("refused to clean" in p for p in problems)


def test_remove_scratch_reports_a_root_it_cannot_list_and_goes_on(tmp_path: Path):
    world, root, afile = tmp_path / "world", tmp_path / "nvme", tmp_path / "afile"
    world.mkdir()
    (root / "zeropp-swap-abc123def456-r1-q").mkdir(parents=True)
    afile.write_text("mine")
    _record(world, 0, afile, "zeropp-swap-abc123def456-r0-")  # the root is a file now: cannot be listed
    _record(world, 1, root, "zeropp-swap-abc123def456-r1-")
    removed, problems = remove_scratch(world, "abc123def456")
    assert removed == [str(root / "zeropp-swap-abc123def456-r1-q")]
    assert len(problems) == 1 and problems[0].startswith(f"could not look for zeropp-swap-abc123def456-r0-* in {afile}")
    assert afile.read_text() == "mine"


def test_the_default_deadline_names_a_stopped_rank_within_30_s():
    from zeropp.experiments.runner.config import LauncherConfig

    deadline = LauncherConfig().heartbeat_s
    # silent for the deadline, plus at most one tick before it went silent and one launcher poll
    assert deadline + HeartbeatMonitor.tick_s(deadline) + 0.5 < 30


def test_flush_publishes_the_last_beat_even_when_the_daemon_has_not_run(tmp_path: Path, monkeypatch):
    """A beat is published by the daemon when it gets the CPU; ``flush`` publishes it from the
    caller at once (what a rank does before stopping itself), with ticks that keep increasing."""
    pub = watch._Publisher(str(tmp_path), 1, tick_s=1.0)  # never started: a daemon starved of the CPU
    monkeypatch.setattr(watch, "_publisher", pub)
    pub.publish()
    watch.heartbeat("train_step", 3)
    before = json.loads((tmp_path / "heartbeat.1").read_text())
    assert (before["beats"], before["phase"], before["step"]) == (0, "start", None)  # not yet published
    watch.flush()
    rec = json.loads((tmp_path / "heartbeat.1").read_text())
    assert (rec["beats"], rec["phase"], rec["step"], rec["tick"]) == (1, "train_step", 3, before["tick"] + 1)
    assert rec["where"].endswith("in test_flush_publishes_the_last_beat_even_when_the_daemon_has_not_run")


def test_flush_without_a_watching_launcher_does_nothing(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(watch, "_publisher", None)
    watch.flush()
    assert list(tmp_path.iterdir()) == []
