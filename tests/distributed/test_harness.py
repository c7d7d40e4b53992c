"""The one launcher (experiments/launch/, placements in experiments/runner/launcher.py) and the tests' run_world over it: results come back
by rank, a failing rank is named with its error and stops the world fast, a timeout or a signal to
the launcher leaves no process behind, and select_device places one GPU per local process.

Here: the gloo-world checks of this topic; its other tiers' checks are in ``tests/unit/test_harness.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.worlds import run_world
from zeropp.experiments.launch import (
    LAUNCHED_MARK,
    LOCAL,
    ModuleEntry,
    Placement,
    PlacementError,
    RankFailure,
    heartbeat,
    launch_world,
)
from zeropp.watch import WORLD_DIR_ENV


def _sum_ranks(rank: int, world: int) -> float:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _raise_on_one(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # rank 0 would wait here forever without the harness's kill


def _stop_one_then_fail(rank: int, world: int, log: str) -> None:
    """Rank 1 stops itself (SIGSTOP); rank 0 then fails, so the launcher stops the world. Rank 1
    logs its SIGTERM and, if it ever runs on past the stop, that it did."""
    path = Path(log)
    if rank == 1:

        def on_term(signum: int, frame: object) -> None:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the process context signals again
            with path.open("a") as f:
                f.write("term\n")
            sys.exit(1)

        signal.signal(signal.SIGTERM, on_term)
        path.write_text("")
        os.kill(os.getpid(), signal.SIGSTOP)
        with path.open("a") as f:
            f.write("ran on\n")  # where a peer's collective would be issued
        return
    while not path.exists():
        time.sleep(0.01)
    time.sleep(0.5)  # rank 1 is stopped by now
    raise ValueError("boom on rank 0")


def _env_and_value(rank: int, world: int, scale: int) -> dict:
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", LAUNCHED_MARK)
    heartbeat("work")  # a function rank may beat too
    beat = json.loads(Path(os.environ[WORLD_DIR_ENV], f"heartbeat.{rank}").read_text())  # published from the start
    return {"value": [rank * scale] * (rank + 1), "beat": beat, **{k: os.environ.get(k) for k in keys}}


def _kill_one(rank: int, world: int) -> None:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def _hang_with_grandchild(rank: int, world: int, pid_dir: str) -> None:
    """Start a grandchild (like wandb's service), record both pids, then hang."""
    child = subprocess.Popen(["sleep", "120"])
    Path(pid_dir, f"rank{rank}").write_text(f"{os.getpid()} {child.pid}")
    time.sleep(120)


def _alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie (no psutil: /proc and kill(0))."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = [ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("State:")]
    except OSError:
        return False
    return not (state and "Z" in state[0])


def _pids(pid_dir: Path, n: int, timeout: float = 60.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while len(list(pid_dir.glob("rank*"))) < n:
        assert time.monotonic() < deadline, "ranks did not start"
        time.sleep(0.1)
    time.sleep(0.2)  # the files are written whole, but give the last write a moment
    return [int(p) for f in sorted(pid_dir.glob("rank*")) for p in f.read_text().split()]


def _start_launcher(script: str, tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    """``script`` (a launcher of ranks that write their pids into the directory it is given) in a
    child process, its stderr in ``tmp_path / "stderr"``; the process and the pid directory."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    with open(tmp_path / "stderr", "w") as err_file:
        p = subprocess.Popen(
            [sys.executable, "-c", script, str(pid_dir)],
            stderr=err_file,
            cwd=Path(__file__).resolve().parents[2],
            env={**os.environ, "TMPDIR": str(tmp_path)},
        )
    return p, pid_dir


def _kill_what_is_left(p: subprocess.Popen, pid_dir: Path) -> None:
    """SIGKILL the launcher and every recorded pid still alive (what a failed test, or a SIGKILLed
    launcher, leaves behind)."""
    if p.poll() is None:
        p.kill()
    for f in pid_dir.glob("rank*"):
        for pid in map(int, f.read_text().split()):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (alive := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


# ---------------------------------------------------------------- run_world (the tests' wrapper)


def test_results_by_rank():
    assert run_world(_sum_ranks, 3) == [3.0, 3.0, 3.0]


def _env_of(rank: int, world: int, keys: list[str]) -> dict:
    return {k: os.environ.get(k) for k in keys} | {"error_file": bool(os.environ.get("TORCHELASTIC_ERROR_FILE"))}


def test_forked_ranks_see_the_callers_environment_of_now(monkeypatch):
    """run_world forks ranks from a fork server started once: each rank still gets the caller's
    environment as it is at the call (a variable set or removed since the server started), and
    torch's error file, as a spawned rank would."""
    monkeypatch.setenv("ZEROPP_TEST_A", "before")
    monkeypatch.setenv("ZEROPP_TEST_B", "set")
    assert run_world(_env_of, 2, ["ZEROPP_TEST_A"])[1]["ZEROPP_TEST_A"] == "before"  # the server runs now
    monkeypatch.setenv("ZEROPP_TEST_A", "after")
    monkeypatch.delenv("ZEROPP_TEST_B")
    keys = ["ZEROPP_TEST_A", "ZEROPP_TEST_B", "RANK"]
    assert run_world(_env_of, 2, keys) == [
        {"ZEROPP_TEST_A": "after", "ZEROPP_TEST_B": None, "RANK": str(r), "error_file": True} for r in range(2)
    ]
    with pytest.raises(ValueError, match="module entries spawn"):
        launch_world(ModuleEntry(module="json.tool"), 1, timeout_s=10, start_method="forkserver")


def test_failing_rank_reports_its_error_without_hanging():
    with pytest.raises(AssertionError, match="boom on rank 1"):
        run_world(_raise_on_one, 2, timeout=60)


# ---------------------------------------------------------------- launch_world: functions


def test_function_world_values_and_env_by_rank():
    out = launch_world(_env_and_value, 3, args=(7,), timeout_s=60, heartbeat_s=30)
    assert [o["value"] for o in out] == [[0], [7, 7], [14, 14, 14]]
    assert all(o["beat"]["pid"] > 0 and o["beat"]["tick"] >= 1 for o in out)
    assert [o["RANK"] for o in out] == [o["LOCAL_RANK"] for o in out] == ["0", "1", "2"]
    assert all(o["WORLD_SIZE"] == o["LOCAL_WORLD_SIZE"] == "3" and o["MASTER_ADDR"] == "127.0.0.1" for o in out)
    assert all(o[LAUNCHED_MARK] is not None for o in out)


def test_raising_rank_is_named_with_its_traceback():
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as e:
        launch_world(_raise_on_one, 3, process_group="gloo", timeout_s=60, grace_s=2)
    assert e.value.rank == 1 and e.value.exit_code != 0
    msg = str(e.value)
    assert msg.startswith("rank 1 ") and "ValueError: boom on rank 1" in msg
    assert "Traceback" in msg and "_raise_on_one" in msg  # the rank's own traceback, not a peer's echo
    assert time.monotonic() - t0 < 30


def test_a_stopped_rank_handles_its_sigterm_before_running_on(tmp_path: Path):
    """Stopping the world signals a stopped rank before continuing it: it never runs on (into a
    collective whose peer is gone) before its SIGTERM handler."""
    log = tmp_path / "rank1.log"
    with pytest.raises(RankFailure, match="boom on rank 0"):
        launch_world(_stop_one_then_fail, 2, args=(str(log),), timeout_s=60, grace_s=2)
    assert log.read_text().splitlines() == ["term"]


def test_killed_rank_is_named():
    with pytest.raises(RankFailure, match=r"rank 1 was killed by SIGKILL") as e:
        launch_world(_kill_one, 2, process_group="gloo", timeout_s=60, grace_s=2)
    assert e.value.rank == 1 and e.value.exit_code == -signal.SIGKILL


def test_timeout_kills_ranks_and_grandchildren(tmp_path: Path):
    t0 = time.monotonic()  # 15 s: long enough for two spawned ranks to start on a loaded 2-core machine
    with pytest.raises(RankFailure, match="timeout of 15s"):
        launch_world(_hang_with_grandchild, 2, args=(str(tmp_path),), timeout_s=15, grace_s=1)
    assert time.monotonic() - t0 < 35
    pids = _pids(tmp_path, 2, timeout=1)
    assert len(pids) == 4 and _wait_gone(pids) == []


# ---------------------------------------------------------------- launch_world: modules


CHECK = "zeropp.experiments.cluster.check"


def test_module_world_runs_with_logs_per_rank(tmp_path: Path):
    out = tmp_path / "out"
    assert launch_world(
        ModuleEntry(module=CHECK, args=("--out", str(out))), 2, log_dir=tmp_path / "ranks", timeout_s=90
    ) == [None, None]
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["sum"] == r["expected"] == 1.0 and r["big_ok"] for r in reports)
    assert [r["env"]["LOCAL_RANK"] for r in reports] == ["0", "1"] and reports[1]["env"]["LOCAL_WORLD_SIZE"] == "2"
    assert (tmp_path / "ranks" / "rank1.log").exists() and not (tmp_path / "ranks" / "rank0.log").exists()


def test_module_rank_failure_names_the_root_cause(tmp_path: Path):
    entry = ModuleEntry(module=CHECK, args=("--out", str(tmp_path / "out"), "--fail-rank", "1"))
    with pytest.raises(RankFailure) as e:
        launch_world(entry, 3, log_dir=tmp_path / "ranks", timeout_s=90, grace_s=2, ranks_per_node=2)
    assert e.value.rank == 1
    assert str(e.value).startswith("rank 1 (node 0) exited with code 1")
    assert "failing on purpose on rank 1" in str(e.value) and "Traceback" in str(e.value)  # from @record's file


_SIGNAL_SCRIPT = textwrap.dedent("""
    import sys
    from tests.distributed.test_harness import _hang_with_grandchild
    from zeropp.experiments.launch import RankFailure, launch_world
    try:
        launch_world(_hang_with_grandchild, 2, args=(sys.argv[1],), timeout_s=120, grace_s=1)
    except RankFailure as e:
        print(type(e).__name__, e, file=sys.stderr)
        sys.exit(e.exit_code)
""")


def _ignore_term_and_hang(rank: int, world: int, pid_dir: str) -> None:
    """A rank slow to stop: it ignores SIGTERM, so the launcher's stop waits its grace period."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    Path(pid_dir, f"rank{rank}").write_text(str(os.getpid()))
    time.sleep(120)


_TWICE_SCRIPT = textwrap.dedent("""
    import sys
    from tests.distributed.test_harness import _ignore_term_and_hang
    from zeropp.experiments.launch import RankFailure, launch_world
    try:
        launch_world(_ignore_term_and_hang, 2, args=(sys.argv[1],), timeout_s=120, grace_s=3)
    except RankFailure as e:
        print(type(e).__name__, e, file=sys.stderr)
        sys.exit(e.exit_code)
""")


def test_a_second_ctrl_c_while_the_ranks_stop_does_not_cut_the_stop_short(tmp_path: Path):
    """Ctrl-C pressed twice: the second arrives while the launcher waits for the ranks to stop. It
    raises nothing inside the stop but kills the ranks' groups at once, so the stop ends with every
    rank gone and the launcher reports the interrupt in one line (before: torch's SignalException
    traceback from inside the stop, and the ranks not yet killed were left to PDEATHSIG)."""
    p, pid_dir = _start_launcher(_TWICE_SCRIPT, tmp_path)
    try:
        pids = _pids(pid_dir, 2)
        p.send_signal(signal.SIGINT)
        time.sleep(1.0)  # inside the 3 s grace period the stop waits for the SIGTERM-ignoring ranks
        p.send_signal(signal.SIGINT)
        p.wait(timeout=30)
        err = (tmp_path / "stderr").read_text()
        assert p.returncode == 128 + signal.SIGINT and "RunInterrupted interrupted by SIGINT" in err, err
        assert "Traceback" not in err and "SignalException" not in err, err
        assert _wait_gone(pids) == []
    finally:
        _kill_what_is_left(p, pid_dir)


_SWALLOWED_SCRIPT = (
    textwrap.dedent("""
    import os, signal, sys, time
    from zeropp.experiments.launch import world
    sent = []
    watched = world.exit_status

    def swallowing_poll(pid):
        if not sent and len(os.listdir(sys.argv[1])) == 2:  # both ranks run: the SIGTERM lands where
            sent.append(pid)  # an exception is lost (a finalizer, a logging handler, an `except Exception`)
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.5)
            except Exception:
                pass
        return watched(pid)

    world.exit_status = swallowing_poll
""")
    + _SIGNAL_SCRIPT
)  # then the launch of the SIGTERM test below


def test_a_signal_landing_where_an_exception_is_swallowed_still_stops_the_world(tmp_path: Path):
    """The launcher's SIGTERM (``kill``, ``timeout``) was an exception raised wherever the main thread
    was; one raised inside code that swallows exceptions was lost, and the launcher watched on, its
    ranks running, until the whole-run timeout. Noted by the handler and acted on by the watch loop,
    it stops every rank: exit 143, one line, nothing left."""
    p, pid_dir = _start_launcher(_SWALLOWED_SCRIPT, tmp_path)
    try:
        pids = _pids(pid_dir, 2)
        p.wait(timeout=30)
        err = (tmp_path / "stderr").read_text()
        assert p.returncode == 128 + signal.SIGTERM and "RunInterrupted interrupted by SIGTERM" in err, err
        assert _wait_gone(pids) == []
    finally:
        _kill_what_is_left(p, pid_dir)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_signal_to_the_launcher_leaves_no_process(tmp_path: Path, sig: signal.Signals):
    """SIGTERM: the launcher stops the ranks and their groups and says so. SIGKILL: no handler
    runs; PDEATHSIG still takes the ranks down (their own grandchildren then need their own
    parent watch, as wandb's service has)."""
    p, pid_dir = _start_launcher(_SIGNAL_SCRIPT, tmp_path)
    try:
        pids = _pids(pid_dir, 2)
        p.send_signal(sig)
        p.wait(timeout=30)
        err = (tmp_path / "stderr").read_text()
        assert p.returncode != 0
        if sig == signal.SIGTERM:
            assert p.returncode == 128 + signal.SIGTERM and "RunInterrupted interrupted by SIGTERM" in err, err
            assert _wait_gone(pids) == []
        else:
            assert _wait_gone(pids[0::2]) == []  # the ranks (the grandchildren belong to them, see below)
    finally:
        _kill_what_is_left(p, pid_dir)


# ---------------------------------------------------------------- devices and placements


def test_function_world_refuses_a_command_prefix():
    prefixed = Placement(master_addr=LOCAL.master_addr, prefixes=(("ip", "netns", "exec", "x"),) * 2)
    with pytest.raises(PlacementError, match="ModuleEntry"):
        launch_world(_sum_ranks, 2, placement=prefixed, timeout_s=10)
