"""The benchmarks as runner jobs: experiments/bench/fsdp.py (both trainers on the same problem) and
experiments/bench/cluster.py (its reading of the summaries; the full run needs namespaces).

Here: the one-process checks. The topic's full description and its end-to-end checks are in
``tests/e2e/test_runtime_bench.py``.
"""

from __future__ import annotations

import argparse
import math
import statistics

import pytest

from tests.bench_helpers import cluster_summary
from zeropp.experiments.bench import cluster as bench_cluster
from zeropp.experiments.bench import cluster_check
from zeropp.experiments.bench.fsdp import job_overrides, parse_args
from zeropp.experiments.runner.overrides import check_overrides


def test_bench_fsdp_jobs_differ_only_in_the_trainer() -> None:
    """Identical overrides except what only our trainer has; every key exists in the runner's schema."""
    a = parse_args(["--quant", "zeropp", "--nodes", "2"])
    ours, fsdp = job_overrides(a, "ours"), job_overrides(a, "fsdp2")
    assert set(ours) - set(fsdp) == {"trainer=zeropp", "stage=3", "quant=zeropp", "zero.prefetch_depth=1"}
    assert set(fsdp) - set(ours) == {"trainer=fsdp2"}
    assert "topology.ranks_per_node=2" in fsdp and "zero.precision=fp32" in fsdp
    check_overrides(ours)
    check_overrides(fsdp)


@pytest.mark.parametrize("argv", [["--nodes", "3"], ["--steps", "0"], ["--quant", "int3"]])
def test_bench_fsdp_refuses_bad_arguments(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2


def test_bench_cluster_reads_the_summaries() -> None:
    """Medians over rounds, compute = step - wait, the projection at the measured rate, the table."""
    a = bench_cluster.parse_args(["--gbps", "1", "--rounds", "3", "--preset", "tiny"])
    assert "cluster.inter_gbps=1.0" in bench_cluster.job_overrides(a, 1.0, "zeropp")
    for mode in bench_cluster.MODES:
        check_overrides(bench_cluster.job_overrides(a, 1.0, mode))
    rows = []
    row: dict = {"gbps": 1.0}
    for mode, quant, steps in (("zero3", "none", (0.5, 0.7, 0.6)), ("zeropp", "zeropp", (0.3, 0.2, 0.4))):
        sums = [cluster_summary(quant, s, 0.1, 2e5) for s in steps]
        sums[0][bench_cluster.UPLINK_KEY] = 4e5 if mode == "zero3" else None  # recorded by some runs only
        m = bench_cluster.aggregate(mode, sums)
        assert m["step_s"] == statistics.median(steps) and m["compute_s"] == pytest.approx(m["step_s"] - 0.1)
        assert m["measured_gbps"] == 0.9 and m["cross_bytes"] == 2e5
        assert m["uplink_bytes"] == (4e5 if mode == "zero3" else None)
        m["predicted"] = p = cluster_check.predict(m, sums[0], m["measured_gbps"])
        assert p["step_s"] > m["compute_s"] and math.isfinite(p["step_s"]) and p["cross_bytes"] > 0
        assert (p["quant_s"] > 0) == (quant == "zeropp")
        row[mode] = m
    row.update(measured_gbps=0.9, speedup=row["zero3"]["step_s"] / row["zeropp"]["step_s"])
    rows.append(row)
    text = bench_cluster.format_rows(rows, a)
    assert "| 1 (0.900) | 0.600 | 0.300 | 2.00x |" in text and "predicted vs measured speedup" in text
    uplink = [line for line in text.splitlines() if line.startswith("| 1 | ZeRO") and "0.40 |" in line]
    assert len(uplink) == 1 and uplink[0].startswith("| 1 | ZeRO-3 | 0.40 |")
    assert "CPU s/step" not in text  # these summaries record no CPU time


def test_bench_cluster_keep_at_turn_reaches_both_modes_and_the_model() -> None:
    """``--keep-at-turn`` sets ``zero.keep_at_turn`` in both modes' jobs, and the prediction's
    Workload, read back from a run's summary, keeps the root and the last block."""
    from zeropp.experiments.projection.scaling_check import workload_from_summary

    on, off = (bench_cluster.parse_args(["--preset", "tiny", *x]) for x in (["--keep-at-turn"], []))
    for mode in bench_cluster.MODES:
        assert "zero.keep_at_turn=true" in bench_cluster.job_overrides(on, 1.0, mode)
        assert "zero.keep_at_turn=false" in bench_cluster.job_overrides(off, 1.0, mode)
        check_overrides(bench_cluster.job_overrides(on, 1.0, mode))
    summary = cluster_summary("none", 0.5, 0.1, 2e5)
    assert workload_from_summary(summary).kept_at_turn() == frozenset()
    summary["config"]["zero"]["keep_at_turn"] = True
    w = workload_from_summary(summary)
    assert w.keep_at_turn and w.kept_at_turn() == {0, len(w.units) - 1}


def test_bench_cluster_says_how_busy_the_cores_were() -> None:
    """The CPU table: per mode the median over rounds of the runs' CPU seconds per step (all ranks)
    and that over step x cores; a run without the figure is left out of the median."""
    a = bench_cluster.parse_args(["--gbps", "1", "--rounds", "3", "--preset", "tiny"])
    row: dict = {"gbps": 1.0, "measured_gbps": 0.9}
    for mode, quant, step, cpus in (
        ("zero3", "none", 0.5, (0.6, None, 0.5)),
        ("zeropp", "zeropp", 0.25, (0.45, 0.5, 0.4)),
    ):
        sums = [cluster_summary(quant, step, 0.1, 2e5) | {"cpu_s_per_step": c} for c in cpus]
        row[mode] = m = bench_cluster.aggregate(mode, sums)
        assert m["cpu_s"] == statistics.median(c for c in cpus if c is not None)
        m["predicted"] = cluster_check.predict(m, sums[0], 0.9)
    row["speedup"] = 2.0
    lines = bench_cluster.format_rows([row], a, cores=2).splitlines()
    assert "| 1 | ZeRO-3 | 0.500 | 0.550 | 0.55 |" in lines  # 0.55 s of CPU in 0.5 s on 2 cores
    assert "| 1 | ZeRO++ | 0.250 | 0.450 | 0.90 |" in lines
    assert any(line.startswith("CPU time of all ranks' processes per step") and "2 cores" in line for line in lines)


def test_bench_cluster_refuses_bad_arguments() -> None:
    for argv in (["--rounds", "0"], ["--gbps", "0,1"]):
        with pytest.raises(SystemExit):
            bench_cluster.parse_args(argv)
    assert isinstance(bench_cluster.parse_args([]), argparse.Namespace)


def test_bench_fsdp_reads_both_summaries(monkeypatch, capsys) -> None:
    from zeropp.experiments.bench import fsdp as bench_fsdp

    def fake_job(overrides: list[str], run_dir) -> dict:
        ours = "trainer=zeropp" in overrides
        return {
            "step_time_s": {"median": 0.2 if ours else 0.4},
            "memory_max_rank_bytes": 3 << 20 if ours else 4 << 20,
            "loss": {"curve": [5.5, 5.4]},
            "tokens_per_s": 1.0,
            "device": "cpu",
            "run_dir": str(run_dir),
        }

    monkeypatch.setattr(bench_fsdp, "run_job", fake_job)
    out = bench_fsdp.main([])
    assert out["time_ratio"] == 0.5 and out["memory_ratio"] == 0.75
    text = capsys.readouterr().out
    assert "4 ranks (1 node(s), cpu)" in text and "GPT small" in text and "0.75" in text
