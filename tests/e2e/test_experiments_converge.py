"""The convergence suite (experiments/studies/converge.py).

Here: the end-to-end checks. The topic's full description and its one-process checks are in
``tests/unit/test_experiments_converge.py``.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from experiments.studies import converge

TINY = ["model=tiny", "topology=1x2", "train.steps=3", "train.micro_batch_size=2", "train.eval_every=2"]


def _summaries(out: Path, scheme: str, seeds: list[int]) -> list[dict[str, Any]]:
    return [json.loads((out / "runs" / scheme / f"seed{s}" / "summary.json").read_text()) for s in seeds]


def test_tiny_suite_table_matches_runs(tmp_path: Path) -> None:
    out = tmp_path / "conv"
    rc = converge.main(["schemes=fp,w4g4", "seeds=2", f"out={out}", *TINY])
    assert rc == 0
    doc = json.loads((out / "converge.json").read_text())
    assert doc["schemes"] == ["fp", "w4g4"] and doc["seeds"] == [0, 1]
    assert all(r["error"] is None for r in doc["runs"]) and len(doc["runs"]) == 4
    rows = {r["scheme"]: r for r in doc["rows"]}
    fp = _summaries(out, "fp", [0, 1])
    for scheme in ("fp", "w4g4"):
        sums = _summaries(out, scheme, [0, 1])
        assert [s["config"]["train"]["seed"] for s in sums] == [0, 1]
        assert sums[0]["config"]["model"]["d_model"] == 32 and sums[0]["topology"]["world_size"] == 2
        row = rows[scheme]
        finals = [s["loss"]["final"] for s in sums]
        evals = [s["loss"]["eval"] for s in sums]
        assert row["seeds"] == [0, 1] and row["failed_seeds"] == []
        assert row["train_loss_final_mean"] == pytest.approx(statistics.fmean(finals), rel=1e-12)
        assert row["train_loss_final_sd"] == pytest.approx(statistics.stdev(finals), rel=1e-12)
        assert row["eval_loss_mean"] == pytest.approx(statistics.fmean(evals), rel=1e-12)
        assert row["eval_loss_sd"] == pytest.approx(statistics.stdev(evals), rel=1e-12)
        assert row["tokens_per_s_mean"] == pytest.approx(statistics.fmean(s["tokens_per_s"] for s in sums), rel=1e-12)
        gaps = [100.0 * (e / f["loss"]["eval"] - 1.0) for e, f in zip(evals, fp)]
        assert [row["gap_pct_per_seed"][str(k)] for k in (0, 1)] == pytest.approx(gaps, rel=1e-12, abs=1e-12)
        assert row["gap_pct_mean"] == pytest.approx(statistics.fmean(gaps), rel=1e-12, abs=1e-12)
    assert rows["fp"]["gap_pct_mean"] == 0.0 and rows["fp"]["outside_seed_spread"] is False
    assert isinstance(rows["w4g4"]["outside_seed_spread"], bool)
    assert _summaries(out, "w4g4", [0])[0]["zero"]["grads"]["bits"] == 4
    assert _summaries(out, "fp", [0])[0]["zero"]["grads"] is None
    md = (out / "converge.md").read_text()
    assert "| fp |" in md and "| w4g4 |" in md and "baseline" in md
    assert f"{rows['w4g4']['eval_loss_mean']:.4f} ± {rows['w4g4']['eval_loss_sd']:.4f}" in md
    csv_lines = (out / "converge.csv").read_text().splitlines()
    assert csv_lines[0].startswith("scheme,") and len(csv_lines) == 3
    png = (out / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
