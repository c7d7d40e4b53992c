"""Config: every library setting is an override, each declared once, and every bad input is one clear
error that names the key, before any rank starts.

Here: the end-to-end checks. The topic's full description and its one-process checks are in
``tests/unit/test_experiments_config.py``.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.experiment_helpers import CLI_ERRORS, run_cli_here


def test_cli_errors_exit_fast_without_ranks(tmp_path) -> None:
    """The real process, as a user runs it: a bad value found only after composition (the corpus
    path) exits 2 within 30 s, names it, and starts nothing."""
    args, words = CLI_ERRORS[6]
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "zeropp.experiments.run", *args, f"hydra.run.dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2, p.stderr
    assert all(w in p.stderr for w in words), p.stderr
    assert time.monotonic() - t0 < 30
    assert not (tmp_path / "ranks").exists()  # nothing was started


def test_help_lists_library_keys(capfd: pytest.CaptureFixture[str]) -> None:
    p = run_cli_here(["--help"], capfd, timeout=60)  # the command's own process: the test above
    assert p.returncode == 0, p.stderr
    for key in ("persistence_threshold", "loss_scale_window", "betas", "warmup_steps", "trainer_job"):
        assert key in p.stdout, key
