"""``python -m experiments.mixz``: the MixZ++ report on the LoRA example (mini, 2 steps, 2x2 gloo;
at the tiny size the per-group scales and padding of shards this small would dominate)."""

from __future__ import annotations

import json

import pytest

from experiments.studies import mixz

STEPS = 2


@pytest.mark.parametrize("hpz", [False, True])
def test_mixz_report_meets_the_targets(tmp_path, capsys, hpz: bool) -> None:
    out = tmp_path / "mixz.json"
    rows = mixz.main(
        ["--preset", "mini", "--steps", str(STEPS), "--lora-rank", "4", "--json", str(out)] + (["--hpz"] if hpz else [])
    )
    assert [r["mode"] for r in rows] == ["none", "int8", "int4"]
    assert json.loads(out.read_text()) == rows
    base = rows[0]
    assert base["frozen_ratio"] == base["cross_ratio"] == 1.0 and base["frozen_cross"] > 0
    for r in rows:  # each rank sends its stored frozen shards to the 2 ranks of the other node, per world
        # gather: forward and backward of every step, or (hpZ) only the first forward's
        assert r["frozen_cross"] == 2 * r["frozen_bytes"] * (1 if hpz else 2 * STEPS), r
    for r in rows[1:]:
        assert r["frozen_ratio"] <= mixz.TARGETS[r["mode"]] and r["cross_ratio"] <= mixz.TARGETS[r["mode"]], r
        assert r["loss_rel"] <= mixz.LOSS_TOL and r["pass"], r
        # the trained part is the same in every run: only the frozen gathers shrink
        assert base["gather_cross"] - r["gather_cross"] == base["frozen_cross"] - r["frozen_cross"]
    assert rows[2]["frozen_bytes"] < rows[1]["frozen_bytes"] < base["frozen_bytes"]
    text = capsys.readouterr().out
    assert "| INT8 |" in text and "| INT4 |" in text and "FAIL" not in text
    assert ("stage 3 + hpZ, bf16" in text) == hpz
