"""The cost model's command lines (``experiments.scaling``, ``experiments.plan``,
``experiments.scaling_check``): a rate, count or fraction the model divides by or scales with, and
a directory with no readable run summary, are usage errors (exit 2) naming the flag or the file,
never a traceback or a table of NaN."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeropp.experiments.projection import scaling_check, speedup
from zeropp.experiments.runner import plan

SCALING = [
    (["--gbps", "0"], "argument --gbps: '0': give a finite number > 0"),  # before: ValueError: invalid cluster
    (["--gbps", "100", "nan"], "argument --gbps: 'nan': give a finite number > 0"),  # before: a table of nan
    (["--ranks-per-node", "0"], "argument --ranks-per-node: '0': give an integer >= 1"),  # ZeroDivisionError
    (["--nics-per-node", "3"], "--nics-per-node 3 must divide --ranks-per-node 8"),
    (["--max-gpus", "4"], "--max-gpus 4 is less than one node (--ranks-per-node 8)"),
    (["--tokens-per-gpu", "0"], "argument --tokens-per-gpu: '0': give an integer >= 1"),  # before: 0 compute
    (["--tflops", "0"], "argument --tflops: '0': give a finite number > 0"),  # ZeroDivisionError
    (["--overlap", "2"], "argument --overlap: '2': give a fraction in [0, 1]"),
    (["--tflops", "fast"], "argument --tflops: 'fast' is not a number"),
    (["--gbps", "100", "100"], "--gbps 100 100 repeats a rate"),  # before: every row printed twice
    # a rate in another unit: before, a table at 1e11 Gbit/s (no link time) or of 1e31 s steps, exit 0
    (["--gbps", "100e9"], "argument --gbps: '100e9': give Gbit/s from 1e-06 to 100000 (a rate in another unit?"),
    (["--tflops", "5e14"], "argument --tflops: '5e14': give TFLOP/s from 1e-06 to 100000"),
    (["--tflops", "1e-30"], "argument --tflops: '1e-30': give TFLOP/s from"),
]


@pytest.mark.parametrize("argv,msg", SCALING, ids=[" ".join(a) for a, _ in SCALING])
def test_scaling_refuses_what_the_model_cannot_use(argv: list[str], msg: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        speedup.main([*argv, "--plot", ""])
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_scaling_prints_a_slow_link_as_given(capsys) -> None:
    speedup.main(["--gbps", "0.0001", "--max-gpus", "16", "--plot", ""])
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip().startswith("0.0001")]
    assert len(rows) == 2 and [r[1] for r in rows] == ["8", "16"]  # before: the rate read 0


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["--tflops", "0"], "argument --tflops: '0': give a finite number > 0"),  # before: ZeroDivisionError
        (["--tflops", "nan"], "argument --tflops: 'nan': give a finite number > 0"),
        (["--gbps", "-1"], "argument --gbps: '-1': give a finite number > 0"),  # before: invalid cluster traceback
        (["--gbps", "1e11"], "argument --gbps: '1e11': give Gbit/s from 1e-06 to 100000"),  # before: accepted
        (["--tflops", "1e-30"], "argument --tflops: '1e-30': give TFLOP/s from"),  # before: a 1e31 s step
    ],
)
def test_plan_refuses_a_rate_that_is_not_positive(argv: list[str], msg: str, capsys, tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as e:
        plan.main(["model=tiny", "--out", str(tmp_path / "plan"), *argv])
    assert e.value.code == 2 and msg in capsys.readouterr().err
    assert not (tmp_path / "plan").exists()


@pytest.mark.parametrize(
    "content,msg",
    [
        (None, "error: no summary.json under"),
        ("{bad", "cannot be read as a run's summary"),  # before: JSONDecodeError traceback
        ("{}", "has no label, config, step_time_s, comm_bytes_per_step; it is not a run's summary"),  # KeyError
        ("[1]", "it is not a run's summary"),  # before: TypeError
    ],
)
def test_scaling_check_refuses_a_directory_without_run_summaries(content, msg, tmp_path: Path, capsys) -> None:
    if content is not None:
        (tmp_path / "r1").mkdir()
        (tmp_path / "r1" / "summary.json").write_text(content)
    with pytest.raises(SystemExit) as e:
        scaling_check.main([str(tmp_path)])
    assert e.value.code == 2 and msg in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--alpha", "-1"], ["--cross-gbps", "0"], ["--intra-gbps", "inf"]])
def test_scaling_check_refuses_a_link_it_cannot_use(argv: list[str], tmp_path: Path, capsys) -> None:
    (tmp_path / "summary.json").write_text(json.dumps({}))
    with pytest.raises(SystemExit) as e:
        scaling_check.main([str(tmp_path), *argv])
    assert e.value.code == 2 and f"argument {argv[0]}" in capsys.readouterr().err


def test_scaling_check_and_the_side_by_side_refuse_a_rate_in_another_unit(tmp_path: Path, capsys) -> None:
    """``scaling_check --cross-gbps 1e9`` (bit/s); ``plan <run> --gbps 0`` took any float (type=float)."""
    from zeropp.experiments.runner import plan_measured

    (tmp_path / "summary.json").write_text(json.dumps({}))
    with pytest.raises(SystemExit) as e:
        scaling_check.main([str(tmp_path), "--cross-gbps", "1e9"])
    assert e.value.code == 2 and "give Gbit/s from" in capsys.readouterr().err
    for flag, bad in (("--gbps", "0"), ("--tflops", "1e-30")):
        with pytest.raises(SystemExit) as e:
            plan_measured._args([str(tmp_path), flag, bad])
        assert e.value.code == 2 and f"argument {flag}" in capsys.readouterr().err
