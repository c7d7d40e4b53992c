"""metrics.jsonl across a stop and a resume: the resumed run cuts the lines logged after its
checkpoint (and a line a crash cut short) before appending, so every step appears once; the
runner's own resume is checked end to end in test_experiments_e2e.py."""

from __future__ import annotations

import json
from pathlib import Path

from zeropp.experiments.runner.metrics import MetricsFile


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def _log(path: Path, steps: range, first_step: int) -> None:
    m = MetricsFile(path, first_step=first_step)
    for s in steps:
        m.write({"step": s, "loss": 1.0 / s})
    m.close()


def test_a_resume_keeps_the_lines_up_to_its_checkpoint(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    _log(path, range(1, 6), first_step=1)  # stopped after step 5, checkpoint at 3
    kept = path.read_bytes().splitlines(keepends=True)[:3]
    _log(path, range(4, 8), first_step=4)  # resumed from the step-3 checkpoint
    assert _steps(path) == [1, 2, 3, 4, 5, 6, 7]
    assert path.read_bytes().startswith(b"".join(kept))  # the earlier lines byte for byte


def test_a_torn_last_line_and_a_fresh_run(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    _log(path, range(1, 4), first_step=1)
    with path.open("a") as f:
        f.write('{"step": 4, "lo')  # the crash came in the middle of a write
    _log(path, range(4, 6), first_step=4)
    assert _steps(path) == [1, 2, 3, 4, 5]
    _log(path, range(1, 3), first_step=1)  # a new run in the same directory starts the file afresh
    assert _steps(path) == [1, 2]
    _log(tmp_path / "new" / "metrics.jsonl", range(1, 3), first_step=1)  # no file yet
    assert _steps(tmp_path / "new" / "metrics.jsonl") == [1, 2]
