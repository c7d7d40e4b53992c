"""``tests.experiment_helpers.run_cli_here``, the runner's command line in the test process that
the end-to-end tests use instead of a runner interpreter: it gives what ``subprocess.run`` gives
(exit status, stdout, stderr), scrubs and restores the environment, starts each command with no
failed multirun job of an earlier one, and stops a command that runs past its timeout (the
test fails with that). The launch
is replaced here (the real one is the end-to-end tier's)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

import zeropp.experiments.runner.run as run
from tests.experiment_helpers import MINI_1X2_CPU, RunnerTimeout, run_cli_here
from zeropp.experiments.launch import RankFailure


def test_the_launch_sees_the_scrubbed_environment_and_its_failure_is_the_exit_status(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, str | None] = {}

    def failing_launch(**_: object) -> dict:
        seen.update(fault=os.environ.get("ZEROPP_INJECT_FAULT"), extra=os.environ.get("ZPP_TEST_EXTRA"))
        print("a rank's line")
        raise RankFailure("rank 1 exited with code 7", rank=1, exit_code=7)

    monkeypatch.setattr(run, "launch", failing_launch)
    monkeypatch.setenv("ZEROPP_INJECT_FAULT", "raise@0:1")  # inherited from the test: not the command's
    p = run_cli_here([*MINI_1X2_CPU, f"hydra.run.dir={tmp_path}"], capfd, env={"ZPP_TEST_EXTRA": "1"}, timeout=120)
    assert p.returncode == 7 and "error: rank 1 exited with code 7" in p.stderr, p.stderr[-2000:]
    assert "a rank's line" in p.stdout
    assert seen == {"fault": None, "extra": "1"}
    assert os.environ["ZEROPP_INJECT_FAULT"] == "raise@0:1" and "ZPP_TEST_EXTRA" not in os.environ  # restored


def test_a_command_past_its_timeout_is_stopped_and_reported(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def stuck_launch(**_: object) -> dict:
        time.sleep(300)
        raise AssertionError("the timeout did not stop the command")

    monkeypatch.setattr(run, "launch", stuck_launch)
    handler = signal.getsignal(signal.SIGALRM)
    with pytest.raises(RunnerTimeout, match="ran past run_cli_here's timeout of 3 s"):
        run_cli_here([*MINI_1X2_CPU, f"hydra.run.dir={tmp_path}"], capfd, timeout=3)
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0) and signal.getsignal(signal.SIGALRM) is handler


def test_exit_status_of_a_refused_config_and_a_fresh_failure_list(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    run._failed.append({"run_dir": "x", "overrides": [], "error": "an earlier command's", "exit_code": 9})
    try:
        p = run_cli_here([*MINI_1X2_CPU, "stage=7", f"hydra.run.dir={tmp_path}"], capfd, timeout=120)
    finally:
        run._failed.pop()
    assert p.returncode == 2 and "error: " in p.stderr and "stage" in p.stderr, p.stderr
    assert "an earlier command's" not in p.stderr and not (tmp_path / "ranks").exists()
