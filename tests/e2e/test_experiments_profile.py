"""``train.profile=true`` end to end: a real 2-rank CPU run writes one Chrome trace per rank of the
chosen step, in which every collective the plan lists for that config is a named range (the plan is
the reference), and ``python -m experiments.plan <run dir>`` puts that step beside its projection.
One run (~25 s on 2 cores) carries every assertion."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest

from experiments.runner.plan import load_config, model_units
from experiments.runner.plan import main as plan_main
from experiments.runner.plan_measured import MEASURED_LANES
from experiments.runner.profiling import read_step, trace_path
from tests.experiment_helpers import run_cli_here
from zeropp.comm import Topology
from zeropp.runtime.plan import build_plan
from zeropp.runtime.plan_kinds import CommKind

FAST = ["train.steps=4", "train.micro_batch_size=4", "model=tiny", "model.seq_len=32", "data.max_bytes=200000"]
"""The end-to-end tier's fast settings (as tests/e2e/test_experiments_e2e.py)."""
ARGS = ["stage=3", "quant=zeropp", "topology=1x2", "logger=none", *FAST]


def test_a_profiled_run_names_its_plan_and_sits_beside_it(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    p = run_cli_here(
        [*ARGS, "train.profile=true", "train.profile_steps=[3]", f"hydra.run.dir={run}"], capfd, timeout=300
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert sorted(x.name for x in (run / "profile").iterdir()) == ["rank0_step3.json", "rank1_step3.json"]

    rc = load_config(ARGS)
    plan = build_plan(model_units(rc), rc.zero, Topology(nodes=1, ranks_per_node=2))
    planned = collections.Counter(plan.range_name(c) for c in plan.collectives if c.kind != CommKind.CONTROL)
    for rank in (0, 1):
        doc = json.loads(trace_path(run, rank, 3).read_text())  # torch's Chrome trace, as Perfetto reads it
        assert all({"ph", "name", "ts", "dur", "pid", "tid"} <= e.keys() for e in doc["traceEvents"] if e["ph"] == "X")
        step, step_s, spans = read_step(trace_path(run, rank, 3))
        assert step == 3 and step_s > 0
        calls = collections.Counter(
            s.name for s in spans if s.parsed.part is None and s.parsed.kind != CommKind.CONTROL
        )
        assert calls == planned, f"rank {rank}"
        assert any(s.parsed.kind == CommKind.CONTROL for s in spans)
        assert {s.parsed.part for s in spans} >= {"quantize", "dequantize", "wait"}

    out = tmp_path / "side"
    capfd.readouterr()
    assert plan_main([str(run), "--out", str(out)]) == 0
    table = capfd.readouterr().out
    for kind in {str(c.kind) for c in plan.collectives} | {"step"}:
        assert any(line.split()[:1] == [kind] for line in table.splitlines()), kind
    assert (out / "step_vs_plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    side = json.loads((out / "step_vs_plan.json").read_text())["traceEvents"]
    measured = collections.Counter(e["name"] for e in side if e["ph"] == "X" and e["pid"] == 1)
    assert measured == collections.Counter(s.name for s in read_step(trace_path(run, 0, 3))[2])
    assert {e["args"]["name"] for e in side if e["ph"] == "M" and e["pid"] == 1 and e["name"] == "thread_name"} == set(
        MEASURED_LANES
    )

    # a step that was not profiled, and a directory that is no run, are refused naming what exists
    assert plan_main([str(run), "--step", "2", "--out", str(out)]) == 2
    assert "rank0_step3.json" in capfd.readouterr().err
    assert plan_main([str(tmp_path / "nowhere")]) == 2
    assert "is not a directory" in capfd.readouterr().err
