"""The peers benchmark (experiments/bench/peers.py): every row the same job, interleaved rounds, medians,
ratios to DDP, peak RSS, loss drift, the table and its JSON; ``bench_fsdp`` as its two-row view.

Here with a fake ``run_job`` that returns scripted summaries; the runner's own jobs (DeepSpeed's
against DDP) are in ``tests/e2e/test_deepspeed_trainer.py``.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from zeropp.experiments.bench import cluster as bench_cluster
from zeropp.experiments.bench import fsdp as bench_fsdp
from zeropp.experiments.bench import gpu as bench_gpu
from zeropp.experiments.bench import peers
from zeropp.experiments.bench.args import round_order
from zeropp.experiments.runner.launcher import RankFailure, RunInterrupted
from zeropp.experiments.runner.overrides import check_overrides
from zeropp.experiments.runner.trainer_registry import TRAINER_SPECS


def _summary(step_s: float, losses: list[float], rss: list[int], state: int = 1 << 20) -> dict[str, Any]:
    """A summary.json as the runner writes it, reduced to what the benchmark reads; ``rss``: each
    rank's lifetime peak at its last phase (earlier phases lower); CPU time: 3 x the step time."""
    return {
        "step_time_s": {"median": step_s},
        "cpu_s_per_step": 3 * step_s,
        "memory_max_rank_bytes": state,
        "loss": {"curve": losses},
        "device": "cpu",
        "memory_by_phase": [
            {"model_creation": {"process": {"peak_rss": r // 2}}, "step": {"process": {"peak_rss": r}}} for r in rss
        ],
    }


class FakeJobs:
    """``run_job`` of scripted rows: row key -> per-round step times; records the order of calls."""

    def __init__(self, steps: dict[str, list[float]], losses: dict[str, list[float]] | None = None) -> None:
        self.steps, self.losses, self.calls = steps, losses or {}, []

    def __call__(self, overrides: list[str], run_dir: Path) -> dict[str, Any]:
        key = Path(run_dir).name.rsplit("-r", 1)[0]
        assert overrides == peers.job_overrides(self.args, key)
        n = sum(1 for k in self.calls if k == key)
        self.calls.append(key)
        step = self.steps[key][n]
        if step < 0:
            raise RankFailure(f"rank 1 of {key} died", exit_code=-9)
        if step == 0:
            raise RunInterrupted("interrupted by SIGTERM; all ranks stopped", exit_code=143)
        return _summary(step, self.losses.get(key, [5.0, 4.0, 3.0]), [100 << 20, 300 << 20])


def _run(argv: list[str], jobs: FakeJobs, tmp_path: Path) -> dict[str, dict[str, Any]]:
    jobs.args = a = peers.parse_args([*argv, "--out", str(tmp_path)])  # type: ignore[attr-defined]
    return peers.aggregate(peers.run_rounds(a, tmp_path, jobs))


def test_every_row_runs_the_same_job_apart_from_its_trainer() -> None:
    a = peers.parse_args(["--quant", "w8g4", "--precision", "bf16"])
    base = set(peers.job_overrides(a, "ddp")) - {"trainer=ddp"}
    for key, row in peers.ROWS.items():
        job = peers.job_overrides(a, key)
        check_overrides(job)
        own = set(job) - base
        zeropp = {f"quant={'w8g4' if key == 'zeropp' else 'none'}"} if row.zeropp else set()
        prefetch = {"zero.prefetch_depth=1"} if row.zeropp and "stage=3" in row.overrides else set()
        assert own == set(row.overrides) | zeropp | prefetch, key
        assert base <= set(job) and "zero.precision=bf16" in job and "optim.lr=0.001" in job
    assert peers.ROWS["deepspeed"].overrides == ("trainer=deepspeed", "stage=3")
    assert {r.trainer for r in peers.ROWS.values()} <= set(TRAINER_SPECS)


def test_rounds_are_interleaved_and_each_row_takes_each_place() -> None:
    keys = ["a", "b", "c"]
    orders = [round_order(keys, r) for r in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    for i in range(3):
        assert sorted(o[i] for o in orders) == keys  # every row once in every place
    assert round_order(keys, 4) == orders[1] and round_order([], 2) == []


def test_medians_over_rounds_ratio_to_ddp_and_loss_drift(tmp_path: Path) -> None:
    jobs = FakeJobs(
        {"ddp": [0.10, 0.30, 0.20], "stage3": [0.25, 0.20, 0.50], "fsdp2": [0.4, 0.4, 0.4]},
        {"ddp": [5.0, 4.0, 3.0], "stage3": [5.0, 4.25, 2.5], "fsdp2": [5.0, 4.0, 3.0]},
    )
    out = _run(["--only", "ddp,stage3,fsdp2", "--rounds", "3"], jobs, tmp_path)
    # round-robin: every row once per round, the round's first row rotating
    assert jobs.calls == ["ddp", "stage3", "fsdp2", "stage3", "fsdp2", "ddp", "fsdp2", "ddp", "stage3"]
    ddp, z3 = out["ddp"], out["stage3"]
    assert ddp["step_s"] == statistics.median([0.10, 0.30, 0.20]) and ddp["step_s_rounds"] == [0.10, 0.30, 0.20]
    assert z3["steps_per_s"] == pytest.approx(1 / 0.25)
    assert z3["ratio"] == pytest.approx((1 / 0.25) / (1 / 0.20)) and ddp["ratio"] == 1.0
    assert z3["loss_drift"] == 0.5 and ddp["loss_drift"] == 0.0 and out["fsdp2"]["loss_drift"] == 0.0
    assert z3["peak_rss_bytes"] == 300 << 20  # the largest rank, its largest phase
    assert z3["cpu_s"] == pytest.approx(3 * 0.25) and z3["cpu_ratio"] == pytest.approx(0.25 / 0.20)


def test_a_failed_row_is_reported_and_not_rerun_while_the_others_go_on(tmp_path: Path, capsys) -> None:
    jobs = FakeJobs({"ddp": [0.1, 0.1], "stage2": [0.2, -1.0]})
    out = _run(["--only", "ddp,stage2", "--rounds", "2"], jobs, tmp_path)
    assert jobs.calls == ["ddp", "stage2", "stage2", "ddp"]
    assert out["stage2"] == {"error": "RankFailure: rank 1 of stage2 died"} and out["ddp"]["ratio"] == 1.0
    assert "stage2: failed: rank 1 of stage2 died" in capsys.readouterr().err


def test_an_interrupted_benchmark_stops_instead_of_recording_a_failed_row(tmp_path: Path) -> None:
    """A SIGTERM to the benchmark (``timeout``, a scheduler) stops every rank of the row in flight:
    that is the whole benchmark stopping, so no later row runs."""
    jobs = FakeJobs({"ddp": [0.1, 0.1], "stage2": [0.0, 0.2]})
    with pytest.raises(RunInterrupted):
        _run(["--only", "ddp,stage2", "--rounds", "2"], jobs, tmp_path)
    assert jobs.calls == ["ddp", "stage2"]


def test_without_the_baseline_there_is_no_ratio_nor_drift(tmp_path: Path) -> None:
    out = _run(["--only", "stage3", "--rounds", "1"], FakeJobs({"stage3": [0.5]}), tmp_path)
    assert out["stage3"]["ratio"] is None and out["stage3"]["loss_drift"] is None
    a = peers.parse_args(["--only", "stage3", "--rounds", "1"])
    assert "zeropp stage 3" in peers.format_table(out, a) and "       -" in peers.format_table(out, a)


def test_loss_curves_of_different_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="loss curves of 2 and 3 steps"):
        peers.loss_drift([1.0, 2.0], [1.0, 2.0, 3.0])


def test_a_row_whose_package_is_missing_is_skipped_with_the_install_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSpeed absent (its module made unimportable): the row is skipped, never run, and the table
    says how to install it; the exit status stays 0."""
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # importlib.util.find_spec now answers None
    jobs = FakeJobs({"ddp": [0.1]})
    argv = ["--only", "ddp,deepspeed", "--rounds", "1", "--out", str(tmp_path)]
    jobs.args = peers.parse_args(argv)  # type: ignore[attr-defined]
    out = peers.main(argv, run_job=jobs)
    assert jobs.calls == ["ddp"]
    assert out["deepspeed"] == {"skipped": "trainer=deepspeed needs DeepSpeed: pip install 'zeropp[peers]'"}
    table = peers.format_table(out, jobs.args)  # type: ignore[attr-defined]
    assert (
        "DeepSpeed ZeRO-3            skipped: trainer=deepspeed needs DeepSpeed: pip install 'zeropp[peers]'" in table
    )


def test_the_table_has_every_figure(tmp_path: Path) -> None:
    jobs = FakeJobs({"ddp": [0.2], "zeropp": [0.25]}, {"ddp": [5.0, 4.0], "zeropp": [5.0, 4.001]})
    out = _run(["--only", "ddp,zeropp", "--rounds", "1", "--world", "2", "--preset", "tiny"], jobs, tmp_path)
    text = peers.format_table(out, jobs.args)  # type: ignore[attr-defined]
    lines = text.splitlines()
    assert lines[0].startswith("GPT tiny seq 64, batch 8/rank, 2 ranks (1 node(s), cpu), fp32; median over 1")
    assert lines[2].split() == ["DDP", "5.00", "1.00", "300.0", "1.00", "0.00e+00", "0.600", "1.00"]
    assert lines[3].split() == [
        "zeropp",
        "ZeRO++",
        "(zeropp)",
        "4.00",
        "0.80",
        "300.0",
        "1.00",
        "1.00e-03",
        "0.750",
        "1.25",
    ]


def test_json_is_the_only_thing_on_stdout(tmp_path: Path, capfd) -> None:
    """With ``--json`` what each job prints goes to stderr, so stdout parses: the runner's own
    report and its ranks', which are child processes writing to the inherited descriptor 1."""

    class Chatty(FakeJobs):
        def __call__(self, overrides: list[str], run_dir: Path) -> dict[str, Any]:
            print("a job's own report")
            subprocess.run([sys.executable, "-c", "print('a rank report')"], check=True)
            return super().__call__(overrides, run_dir)

    argv = ["--only", "ddp,stage0", "--rounds", "1", "--json", "--out", str(tmp_path)]
    jobs = Chatty({"ddp": [0.1], "stage0": [0.1]})
    jobs.args = peers.parse_args(argv)  # type: ignore[attr-defined]
    out = peers.main(argv, run_job=jobs)
    captured = capfd.readouterr()
    assert json.loads(captured.out) == json.loads(json.dumps(out))
    assert "a job's own report" in captured.err and "a rank report" in captured.err


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--only", "ddp,nccl"], "--only nccl: choose rows from ddp, fsdp2, deepspeed"),
        (["--only", "ddp,ddp"], "--only (empty or repeated)"),
        (["--rounds", "0"], "--rounds must be >= 1, got 0"),
        (["--world", "4", "--nodes", "3"], "--nodes 3 must divide --world 4"),
        # settings the runner refuses for every row: before, each row failed alike, exit 1
        (["--preset", "huge"], "row ddp: invalid config: model='huge' is not a model option"),
        (["--only", "stage2", "--lr", "nan"], "row stage2: invalid config: optim.lr=nan"),
        (["--only", "ddp", "--world", "0"], "row ddp: invalid config topology: topology.ranks_per_node"),
        (["--only", "ddp", "--out", "/proc/peers"], "--out='/proc/peers' cannot be written"),  # a traceback
    ],
)
def test_bad_arguments_are_usage_errors(argv: list[str], words: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        peers.parse_args(argv)
    assert e.value.code == 2 and words in capsys.readouterr().err


def test_a_row_must_name_its_trainer() -> None:
    with pytest.raises(ValueError, match="must name the trainer"):
        dataclasses.replace(peers.ROWS["ddp"], overrides=("stage=3",))


@pytest.mark.parametrize("quant, ours", [("none", "stage3"), ("zeropp", "zeropp")])
def test_bench_fsdp_runs_the_peers_jobs_of_its_two_rows(quant: str, ours: str) -> None:
    a = bench_fsdp.parse_args(["--quant", quant, "--nodes", "2"])
    assert bench_fsdp.job_overrides(a, "ours") == peers.job_overrides(a, ours)
    assert bench_fsdp.job_overrides(a, "fsdp2") == peers.job_overrides(a, "fsdp2")


def test_an_out_holding_runs_is_refused_once_before_any_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The runner refuses a fresh run where a run's records are: a re-used --out would fail every
    row one by one, so the benchmark says it once, up front. An empty or new --out is fine."""
    peers.parse_args(["--out", str(tmp_path / "new")])
    (tmp_path / "old" / "ddp-r1").mkdir(parents=True)
    peers.parse_args(["--out", str(tmp_path / "old")])  # a directory without records
    (tmp_path / "old" / "ddp-r1" / "summary.json").write_text("{}")
    with pytest.raises(SystemExit) as e:
        peers.parse_args(["--out", str(tmp_path / "old")])
    assert e.value.code == 2 and "already holds runs" in capsys.readouterr().err


@pytest.mark.parametrize(
    "parse, argv, row",
    [
        (peers.parse_args, ["--only", "ddp,stage3", "--rounds", "2"], "stage3-r2"),
        (bench_gpu.parse_args, ["--device", "cpu", "--jobs", "stage0,stage3"], "stage3"),
        (bench_gpu.parse_args, ["--device", "cpu", "--jobs", "stage3", "--rounds", "2"], "stage3-r1"),
        (bench_fsdp.parse_args, [], "fsdp2"),
        (bench_cluster.parse_args, ["--gbps", "0.5,2"], "0.5gbps"),
    ],
)
def test_a_users_folder_where_a_job_would_write_is_refused(
    parse: Any, argv: list[str], row: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A folder in --out under the name of one of the jobs (but holding no run) would get the job's
    logs and records among the user's files: refused up front, untouched; an empty one is fine."""
    (tmp_path / row).mkdir()
    parse([*argv, "--out", str(tmp_path)])
    (tmp_path / row / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as e:
        parse([*argv, "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"already holds {tmp_path / row}, where this benchmark would write" in err
    assert [f.name for f in tmp_path.rglob("*")] == [row, "notes.txt"]


def test_a_prefetch_depth_without_a_stage3_row_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        peers.parse_args(["--only", "ddp,stage2", "--prefetch", "3"])
    assert "--prefetch 3 does nothing" in capsys.readouterr().err
    assert peers.parse_args(["--only", "ddp,stage3", "--prefetch", "3"]).prefetch == 3


def test_rows_this_host_cannot_start_are_refused_before_the_first(monkeypatch, capsys) -> None:
    """Before: each row failed alike (more local CPU ranks than the host runs), exit 1."""
    from zeropp.experiments.runner import preflight
    from zeropp.experiments.runner import run as runner

    monkeypatch.setattr(preflight, "host_cpus", lambda: 2)
    monkeypatch.setattr(runner, "run_job", lambda *a, **k: pytest.fail("a row was started"))
    with pytest.raises(SystemExit) as e:
        peers.main(["--device", "cpu", "--world", "64", "--only", "ddp,stage0", "--rounds", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "error: row ddp: invalid config: topology.nodes=1 x topology.ranks_per_node=64" in err
