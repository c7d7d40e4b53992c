"""experiments/bench/gpu.py: argument handling and the table with a fake ``run_job``, and one real
run of the smallest configuration on CPU (two rows, world 1).

Here: the one-process checks of this topic; its other tiers' checks are in ``tests/e2e/test_bench_gpu.py``.
"""

from __future__ import annotations

import math

import pytest

from tests.bench_helpers import CPU_TINY
from zeropp.experiments.bench import gpu as bench_gpu
from zeropp.experiments.runner.config import ConfigError
from zeropp.experiments.runner.launcher import RunInterrupted


def fake_summary(step_s: float, memory: int = 3 * 2**20) -> dict:
    return {
        "step_time_s": {"median": step_s},
        "memory_max_rank_bytes": memory,
        "tokens_per_s": 1000.0 / step_s,
        "model": {"params": 151_000_000},
        "device": "cuda:0 (fake)",
    }


def test_defaults_are_the_issue_model_and_every_row():
    a = bench_gpu.parse_args([])
    assert a.jobs == list(bench_gpu.JOBS) and (a.d_model, a.n_layers, a.n_heads, a.seq, a.batch) == (
        1024,
        12,
        16,
        512,
        8,
    )
    ov = bench_gpu.job_overrides(a, "zeropp")
    assert ov[:3] == ["trainer=zeropp", "stage=3", "quant=zeropp"]
    for want in (
        "topology=1x1",
        "model=large",
        "model.d_model=1024",
        "model.n_layers=12",
        "model.n_heads=16",
        "model.seq_len=512",
        "train.micro_batch_size=8",
        "train.steps=25",
        "train.throughput_skip_steps=5",
        "zero.precision=bf16",
        "launcher.device=cuda",
        "logger=none",
    ):
        assert want in ov
    assert bench_gpu.job_overrides(a, "torch")[0] == "trainer=ddp"
    # 0 keeps the preset's shape: no model.* size overrides
    tiny = bench_gpu.parse_args(CPU_TINY)
    assert not any(
        o.startswith(("model.d_model", "model.n_layers", "model.n_heads"))
        for o in bench_gpu.job_overrides(tiny, "stage0")
    )


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["--jobs", "stage0,stage9"], "stage9"),
        (["--jobs", ","], "empty"),
        (["--steps", "0"], "--steps"),
        (["--warmup", "-1"], "--warmup"),
        (["--d-model", "-2"], "--d-model"),
        (["--precision", "fp16"], "precision"),
        # settings the runner refuses for every row: before, each row failed alike, exit 1
        (["--jobs", "torch", "--preset", "huge"], "row torch: invalid config: model='huge' is not a model option"),
        (["--jobs", "stage3", "--d-model", "10", "--n-heads", "3"], "row stage3: invalid config model: GPTConfig"),
        (["--jobs", "torch", "--out", "/proc/gpu"], "--out='/proc/gpu' cannot be written"),  # before: a traceback
    ],
)
def test_bad_arguments_are_refused(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        bench_gpu.parse_args(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_table_with_a_fake_run_job(capsys, tmp_path):
    times = {"torch": 0.020, "fsdp2": 0.030, "stage0": 0.0226, "stage3": 0.0456, "zeropp": 0.0508}
    seen = []

    def run_job(overrides, run_dir):
        key = run_dir.name
        seen.append((key, overrides))
        if key == "qwz":
            raise ConfigError("quant: 'int8' is broken here\nsecond line")
        return fake_summary(times[key])

    rows = bench_gpu.main(["--jobs", "torch,fsdp2,stage0,stage3,qwz,zeropp", "--out", str(tmp_path)], run_job=run_job)
    assert [k for k, _ in seen] == ["torch", "fsdp2", "stage0", "stage3", "qwz", "zeropp"]
    assert "error" in rows["qwz"] and math.isclose(rows["stage3"]["step_s"], 0.0456)
    out = capsys.readouterr()
    table = out.out.splitlines()
    assert "151.0M parameters" in table[0] and "cuda:0 (fake)" in table[0]
    by_label = {line[:24].strip(): line[24:].split() for line in table[2:]}
    assert by_label["zeropp stage 0"] == ["22.60", "1.00", "3.0", "44248"]
    assert by_label["zeropp stage 3"][:2] == ["45.60", "2.02"]
    assert by_label["stage 3 + ZeRO++"][:2] == ["50.80", "2.25"]
    assert by_label["torch (DDP, world 1)"][:2] == ["20.00", "0.88"]
    assert by_label["stage 3 + qwZ (int8)"][0] == "failed:" and "second line" not in table[-2]
    assert "qwz: failed" in out.err


def test_rounds_interleave_and_take_the_median(capsys, tmp_path):
    """``--rounds 3``: every row once per round, each round's order rotated, a run directory per
    round; a row's figure is the median of its rounds and the table shows their range. A row that
    fails is not run again and the others go on."""
    times = {"stage0": [0.030, 0.020, 0.022], "stage3": [0.050, 0.041, 0.044]}
    seen = []

    def run_job(overrides, run_dir):
        key = run_dir.name.rsplit("-r", 1)[0]
        seen.append(run_dir.name)
        if key == "fsdp2":
            raise ConfigError("no fsdp2 here")
        return fake_summary(times[key].pop(0))

    rows = bench_gpu.main(["--jobs", "stage0,stage3,fsdp2", "--rounds", "3", "--out", str(tmp_path)], run_job=run_job)
    assert seen == ["stage0-r1", "stage3-r1", "fsdp2-r1", "stage3-r2", "stage0-r2", "stage0-r3", "stage3-r3"]
    assert math.isclose(rows["stage0"]["step_s"], 0.022) and math.isclose(rows["stage3"]["step_s"], 0.044)
    assert rows["stage3"]["step_s_rounds"] == [0.050, 0.041, 0.044] and "error" in rows["fsdp2"]
    table = capsys.readouterr().out.splitlines()
    assert "median over 3 interleaved rounds" in table[0] and table[1].split()[-1] == "range"
    by_label = {line[:24].strip(): line[24:].split() for line in table[2:]}
    assert by_label["zeropp stage 0"] == ["22.00", "1.00", "3.0", "45455", "20.00-30.00"]
    assert by_label["zeropp stage 3"][:2] == ["44.00", "2.00"] and by_label["zeropp stage 3"][-1] == "41.00-50.00"


def test_an_interrupt_stops_the_benchmark_instead_of_failing_one_row(capsys, tmp_path):
    seen = []

    def run_job(overrides, run_dir):
        seen.append(run_dir.name)
        if run_dir.name == "stage3":
            raise RunInterrupted("interrupted by SIGTERM; all ranks stopped", exit_code=143)
        return fake_summary(0.02)

    with pytest.raises(RunInterrupted):
        bench_gpu.main(["--jobs", "stage0,stage3,zeropp", "--out", str(tmp_path)], run_job=run_job)
    assert seen == ["stage0", "stage3"]
    # what finished before the interrupt is still printed (a part cut by gpu_check's cap keeps its table)
    table = capsys.readouterr().out.splitlines()
    labels = [line[:24].strip() for line in table[2:-1]]
    assert labels == ["zeropp stage 0"] and table[-1].startswith("(stopped:")


def test_table_without_stage0_has_no_ratios(capsys):
    bench_gpu.main(["--jobs", "stage3"], run_job=lambda ov, d: fake_summary(0.05))
    line = capsys.readouterr().out.splitlines()[-1]
    assert line[24:].split()[:2] == ["50.00", "-"]


def test_rows_this_host_cannot_start_are_refused_before_the_first(monkeypatch, capsys):
    """Before: every row failed alike (``launcher.device=cuda starts 1 ranks on this host but it
    has 0 GPU(s)``), exit 1. Only with the real runner: a fake run_job starts nothing here."""
    import torch

    from zeropp.experiments.runner import run as runner

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(runner, "run_job", lambda *a, **k: pytest.fail("a row was started"))
    with pytest.raises(SystemExit) as e:
        bench_gpu.main(["--jobs", "torch,stage0", "--device", "cuda"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "error: row torch: invalid config: launcher.device=cuda starts 1 ranks" in err
