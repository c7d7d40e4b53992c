"""``python -m experiments.bench_cluster --check``'s plumbing: the grid it runs, the table it prints
and its verdict, with the runner jobs and the host measurements stubbed (the real grid needs
root and network namespaces and minutes; its output is in docs/benchmarks.md)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from zeropp.comm.spec import RECIPES
from zeropp.experiments.bench import cluster as bench_cluster
from zeropp.experiments.bench import cluster_check
from zeropp.experiments.projection.scaling import gpt_units

MODEL = {"vocab_size": 256, "seq_len": 16, "d_model": 32, "n_layers": 2, "n_heads": 2, "mlp_ratio": 4}


def _summary(overrides: list[str], step: float, wait: float) -> dict:
    """A summary.json of the runner's layout for one bench job (the fields the bench reads)."""
    quant = next(o.split("=", 1)[1] for o in overrides if o.startswith("quant="))
    r = RECIPES[quant]

    def asd(s):
        return None if s is None else dataclasses.asdict(s)

    zero = {
        "stage": 3,
        "precision": "fp32",
        "hpz": r.hpz,
        "hpz_size": None,
        "grad_accum_steps": 1,
        "weights": asd(r.weights),
        "grads": asd(r.grads),
    }
    emulated = "cluster=emulated" in overrides
    gbps = next((float(o.split("=")[1]) for o in overrides if o.startswith("cluster.inter_gbps=")), None)
    cfg = {
        "zero": zero,
        "model": MODEL,
        "topology": {"nodes": 2, "ranks_per_node": 2, "hpz_size": None},
        "train": {"micro_batch_size": 2},
        "trainer": {"name": "zeropp"},
        "cluster": {"name": "emulated" if emulated else "local", "inter_gbps": gbps, "inter_latency_ms": 0.0},
    }
    return {
        "config": cfg,
        "step_time_s": {"median": step, "mean": step},
        "engine_comm_wait_s_per_step": wait,
        "comm_wait_s_per_step": wait,
        "engine_comm_bytes_per_step": {"by_link": {"cross": 1e5, "intra": 1e5}},
        "placement": {"cluster": "emulated", "measured_gbps": 0.96 * gbps} if emulated else None,
        "model": {"params": sum(gpt_units(vocab=256, seq_len=16, d_model=32, n_layers=2)), "flops_per_token": 1.0},
        "loss": {"first": 5.6, "final": 5.5},
        "run_dir": "x",
    }


@pytest.fixture
def stubbed(monkeypatch):
    """No namespaces, no jobs: each job's step = 0.1 s compute + a wait; host rates fixed."""
    jobs: list[list[str]] = []

    def run_job(overrides: list[str], run_dir) -> dict:
        jobs.append(list(overrides))
        return _summary(overrides, 0.1 + WAIT[0], WAIT[0])

    monkeypatch.setattr(bench_cluster, "require_privileges", lambda *a, **k: None)
    monkeypatch.setattr(bench_cluster, "run_job", run_job)
    monkeypatch.setattr(bench_cluster, "measure_loopback_gbps", lambda world: 2.0)
    monkeypatch.setattr(
        cluster_check,
        "measure_quant_rates_contended",
        lambda w, c: (
            ("quantize", 4, 1.0),
            ("quantize", 8, 1.0),
            ("dequantize", 8, 1.0),
            ("dequantize_sum", 4, 1.0),
            ("dequantize_sum_requantize", 4, 1.0),
        ),
    )
    return jobs


WAIT = [0.05]


def test_check_runs_its_grid_and_prints_the_error_per_cell(stubbed, capsys) -> None:
    WAIT[0] = 0.05  # every job (shaped or not) waits the same: the hybrid prediction is close
    code = bench_cluster.main(["--check"])
    out = capsys.readouterr().out
    # the grid: 2 rates x 2 modes, three runs each, plus three unshaped references per mode
    shaped = [j for j in stubbed if "cluster=emulated" in j]
    local = [j for j in stubbed if "cluster=local" in j]
    assert sorted({o for j in shaped for o in j if o.startswith("cluster.inter_gbps=")}) == [
        "cluster.inter_gbps=0.2",
        "cluster.inter_gbps=1.0",
    ]
    assert len(shaped) == 12 and len(local) == 6 and all("train.steps=4" in j for j in stubbed)
    assert "Scaling model check" in out and "| 0.2 (0.192) | ZeRO-3 |" in out and "| 1 (0.960) | ZeRO++ |" in out
    lines = [ln for ln in out.splitlines() if ln.startswith("| 0.2 (") or ln.startswith("| 1 (")]
    assert len([ln for ln in lines if ln.count("%") == 3]) == 4  # scheduled, hybrid and serial error per cell
    verdict = next(ln for ln in out.splitlines() if ln.startswith("check ("))
    assert ("PASS" in verdict) == (code == 0) and verdict.startswith("check (scheduled model)")
    assert "serial model: worst" in verdict and "CPU scale" in out


def _cell(**kw) -> dict:
    """One ``--check`` cell with only the serial (analytic) prediction, as without unshaped runs."""
    cell = {
        "gbps": 1.0,
        "measured_gbps": 0.96,
        "mode": "zero3",
        "measured_s": 1.0,
        "comm_wait_s": 0.5,
        "quant_s": 0.0,
        "local_comm_wait_s": None,
        "cpu_scale": None,
        "analytic_s": 1.1,
        "analytic_error": 0.1,
        "hybrid_s": None,
        "hybrid_error": None,
        "scheduled_s": None,
        "scheduled_error": None,
    }
    return {**cell, **kw}


def test_check_fails_when_a_cell_is_off() -> None:
    text, ok = cluster_check.format_check([_cell()])
    assert ok and "PASS" in text and "+10.0%" in text and "check (serial model)" in text
    text, ok = cluster_check.format_check([_cell(analytic_s=1.2, analytic_error=0.2)])
    assert not ok and "FAIL" in text and "outside" in text
    # with the unshaped reference the verdict is on the scheduled model, whatever the serial one reads
    local = dict(
        local_comm_wait_s=0.1, cpu_scale=1.5, hybrid_s=1.05, hybrid_error=0.05, scheduled_s=0.95, scheduled_error=-0.05
    )
    text, ok = cluster_check.format_check([_cell(analytic_s=1.3, analytic_error=0.3, **local)])
    assert ok and "check (scheduled model): PASS" in text and "serial model: worst 30.0%" in text
    text, ok = cluster_check.format_check([_cell(**{**local, "scheduled_s": 0.8, "scheduled_error": -0.2})])
    assert not ok and "outside" in text


def test_check_keeps_explicit_arguments() -> None:
    a = bench_cluster.parse_args(["--check", "--gbps", "0.5", "--steps", "2"])
    assert a.gbps == [0.5] and a.steps == 2 and a.rounds == 3 and a.warmup == 1
    a = bench_cluster.parse_args(["--check"])
    assert a.gbps == [0.2, 1.0] and a.steps == 3


def test_check_prints_max_error_and_honours_tolerance(stubbed, capsys) -> None:
    cells = [_cell(analytic_s=1.12, analytic_error=0.12)]
    text, ok = cluster_check.format_check(cells, tolerance=0.10)
    assert not ok and "max |error|: 12.0% (tolerance 10%)" in text
    text, ok = cluster_check.format_check(cells)
    assert ok and "max |error|: 12.0%" in text
    assert bench_cluster.parse_args(["--check"]).tolerance == 15.0
    assert bench_cluster.parse_args(["--check", "--tolerance", "5"]).tolerance == 5.0
    with pytest.raises(SystemExit):
        bench_cluster.parse_args(["--check", "--tolerance", "0"])
    WAIT[0] = 0.05
    code = bench_cluster.main(["--check", "--tolerance", "1e-9"])
    out = capsys.readouterr().out
    verdict = next(ln for ln in out.splitlines() if ln.startswith("check ("))
    assert "max |error|:" in out and "tolerance 1e-09%" in out and ("PASS" in verdict) == (code == 0)


def test_workload_from_summary_takes_hf_summaries() -> None:
    from zeropp.experiments.projection.scaling_check import summary_units, workload_from_summary

    s = _summary(["quant=zeropp", "cluster=emulated", "cluster.inter_gbps=1.0"], 0.2, 0.1)
    gpt = workload_from_summary(s)
    assert gpt.units == gpt_units(vocab=256, seq_len=16, d_model=32, n_layers=2)
    hf_model = {
        "kind": "hf",
        "vocab_size": 256,
        "seq_len": 16,
        "d_model": 32,
        "n_layers": 3,
        "n_heads": 2,
        "intermediate_size": 88,
    }
    hf = {**s, "config": {**s["config"], "model": hf_model}, "model": {"params": 100_007, "flops_per_token": 1.0}}
    units = summary_units(hf)
    assert sum(units) == 100_007 and len(units) == 4 and units[1] == units[2] == units[3]
    w = workload_from_summary(hf)  # no KeyError on GPT-only fields
    assert w.units == units and w.tokens_per_rank == 2 * 16


def test_check_with_a_cluster_file_compares_it_with_the_hand_set_constants(stubbed, capsys, tmp_path) -> None:
    """The file's latencies and intra-node rate replace the hand-set ones in every prediction of
    the same runs; both tables print, and a line says whether the file's worst error is no worse."""
    from zeropp.experiments.projection.cluster_file import ClusterFile, LinkFit, write_cluster_file

    WAIT[0] = 0.05
    path = tmp_path / "cluster.json"
    links = {"intra": LinkFit(alpha_s=1e-3, gbps=0.5), "inter": LinkFit(alpha_s=2e-3, gbps=0.1, ranks=4)}
    write_cluster_file(path, ClusterFile(nodes=2, ranks_per_node=2, backend="gloo", links=links))
    bench_cluster.main(["--check", "--cluster-file", str(path), "--json", str(tmp_path / "rows.json")])
    out = capsys.readouterr().out
    assert f"links from {path}" in out and "The same runs with the hand-set constants" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("calibrated vs hand-set"))
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    cal, hand = cluster_check.check_cells(rows), cluster_check.check_cells(rows, "predicted_handset")
    assert [c["scheduled_s"] for c in cal] != [c["scheduled_s"] for c in hand]  # the file changed the model
    worse = cluster_check.worst_error(cal)[1] > cluster_check.worst_error(hand)[1]
    assert ("WORSE" in line) == worse and ("no worse" in line) == (not worse)
    # the serial model's link constants are the file's, the cross-node rate the cell's probe
    z3 = rows[0]["zero3"]
    serial = cluster_check.predict(
        z3, _summary(["quant=none", "cluster=emulated", "cluster.inter_gbps=0.2"], 0.15, 0.05), 0.192
    )
    assert z3["predicted"]["step_s"] > serial["step_s"]  # 1-2 ms per message step against 50-100 us


def test_check_refuses_a_bad_cluster_file_before_any_run(stubbed, capsys, tmp_path) -> None:
    bad = tmp_path / "cluster.json"
    bad.write_text(json.dumps({"kind": "zeropp-cluster", "version": 1, "links": {}}))
    assert bench_cluster.main(["--check", "--cluster-file", str(bad)]) == 2
    assert "error:" in capsys.readouterr().err and stubbed == []  # no job ran
