"""Run the experiment runner's command line in this process: the real ``cli()`` (override
pre-check, Hydra composition, validation, the runner's pre-launch checks) with ``sys.argv`` set,
without an interpreter start-up per call. Launching is replaced by an assertion, so a config
that was wrongly accepted fails the test (exit 1 with that message) instead of starting ranks.
Also the unwritable directory that the runner's directory checks are provoked with."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest


def run_cli(
    args: list[str], run_dir: Path | None, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> tuple[int, str]:
    """``python -m zeropp.experiments.run *args hydra.run.dir=run_dir`` in-process: (exit code, stderr).
    ``run_dir`` None: no ``hydra.run.dir`` on the command line (the config's own, or Hydra's default)."""
    import zeropp.experiments.runner.job as job
    import zeropp.experiments.runner.run as run

    def no_launch(**_: object) -> dict:
        raise AssertionError("the runner accepted this config and would have started ranks")

    monkeypatch.setattr(job, "launch", no_launch)
    given = [] if run_dir is None else [f"hydra.run.dir={run_dir}"]
    monkeypatch.setattr(sys, "argv", ["zeropp.experiments.run", *args, *given])
    capfd.readouterr()
    with pytest.raises(SystemExit) as e:
        run.cli()
    err = capfd.readouterr().err
    assert run_dir is None or not (run_dir / "ranks").exists(), "a rank was started"
    return int(e.value.code or 0), err


ROOT = os.geteuid() == 0
"""Whether this process runs as root, whom permission bits do not stop."""


def unwritable_dir(tmp_path: Path) -> Path | str:
    """A directory this process really cannot create files in (root ignores permission bits)."""
    if ROOT:
        return "/proc"
    d = tmp_path / "readonly"
    d.mkdir()
    d.chmod(0o500)
    return d
