"""``python -m experiments.memory``, ``memory.json``, the summary's per-phase memory and the
report's per-phase bars, on one short real run (model=mini, 2 steps, 2x2 gloo ranks).

Here: the end-to-end checks of this topic; its other tiers' checks are in ``tests/unit/test_experiments_memory.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from zeropp.experiments.runner import memory as memcmd
from zeropp.experiments.runner.console import summary_rows
from zeropp.experiments.studies.report import PLOTS, write_report
from zeropp.runtime.memory import MODEL_STATE, PHASES, TIERS, tier_totals

FAST = ["model=mini", "topology=2x2", "train.micro_batch_size=2", "data.max_bytes=200000"]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("memrun")
    return memcmd.main([*FAST, "stage=2", "--run-dir", str(run_dir)]), run_dir


def test_short_run_measures_every_phase_and_tier_within_5_percent(measured, capsys):
    out, run_dir = measured
    doc = json.loads((run_dir / "memory.json").read_text())
    assert doc == out["measured"] and len(doc["ranks"]) == 4
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2  # the command's short-run default
    want = tier_totals(doc["expected"])
    for r in doc["ranks"]:
        assert list(r["phases"]) == list(PHASES)
        assert r["peak"] == max(p["peak"] for p in r["phases"].values()) > 0 and r["peak_rss"] > 0
        got = tier_totals(r["phases"]["backward"]["tiers"], MODEL_STATE)
        for t in TIERS:
            assert abs(got[t] - want[t]) <= 0.05 * want[t] if want[t] else got[t] == 0, (t, got, want)
    # the summary carries the same per-rank figures, and the console shows them
    assert summary["memory_by_phase"] == [r["phases"] for r in doc["ranks"]]
    rows = dict(summary_rows(summary))
    assert "memory by phase" in rows and any(k.strip().startswith("backward") for k in rows)
    assert "ZeRO formula / rank" in {k.strip() for k in rows}


def test_report_draws_per_phase_bars(measured, tmp_path):
    _, run_dir = measured
    path = write_report(run_dir, tmp_path)
    md = path.read_text()
    assert "Memory by phase" in md and "| ZeRO-2 | backward |" in md and "| ZeRO-2 | model creation |" in md
    assert "All runs: ZeRO-2, fp32, mini model, 2x2 ranks." in md
    for name in PLOTS:
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def test_command_line_entry(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "zeropp.experiments.memory", "--predict-only", "model=tiny", "topology=1x2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert "Predicted model state per rank: model=tiny" in p.stdout
    with pytest.raises(SystemExit):
        memcmd.main(["--bogus"])
