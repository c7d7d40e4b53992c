"""The convergence suite (experiments/studies/converge.py): a real tiny suite whose table must equal its
runs' summary.json values, the gap formula and the seed-spread rule against hand-computed numbers
(a stand-in runner), a failed run that is reported while the suite goes on, and bad inputs.

Here: the one-process checks of this topic; its other tiers' checks are in
``tests/e2e/test_experiments_converge.py``.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from zeropp.experiments.runner.compose import compose_run
from zeropp.experiments.runner.config import ConfigError
from zeropp.experiments.runner.launcher import RunInterrupted
from zeropp.experiments.studies import converge, converge_suite

TINY = ["model=tiny", "topology=1x2", "train.steps=3", "train.micro_batch_size=2", "train.eval_every=2"]


def _fake_runner(evals: dict[tuple[str, int], float], fail: set[tuple[str, int]]):
    """A runner that writes a metrics.jsonl and returns a summary with the given eval loss."""
    calls: list[list[str]] = []

    def run(overrides: list[str], run_dir: Path) -> dict[str, Any]:
        calls.append(overrides)
        scheme = {"quant=none": "fp", "quant=w4g4": "w4g4", "quant=int8": "int8"}[
            next(o for o in overrides if o.startswith("quant="))
        ]
        if "zero.grads.error_feedback=true" in overrides:
            scheme = "w4g4_ef"
        seed = int(next(o for o in overrides if o.startswith("train.seed=")).split("=")[1])
        if (scheme, seed) in fail:
            raise RuntimeError(f"rank 1 died ({scheme} {seed})")

        run_dir.mkdir(parents=True, exist_ok=True)
        lines = [{"step": s, "loss": 5.0 - s - seed, "eval_loss": 4.0 if s == 2 else None} for s in (1, 2, 3)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        return {
            "loss": {"final": 3.0 - seed, "eval": evals[(scheme, seed)]},
            "tokens_per_s": 100.0 + seed,
            "tokens_per_step": 64,
            "steps": 3,
            "first_step": 1,
            "model": {"name": "tiny", "params": 1},
        }

    return run, calls


def test_gap_formula_seed_spread_and_failed_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    evals = {
        ("fp", 0): 2.00,
        ("fp", 1): 2.02,
        ("w4g4", 0): 2.20,
        ("w4g4", 1): 2.21,
        ("w4g4_ef", 0): 2.01,
        ("w4g4_ef", 1): 2.02,
        ("int8", 0): 2.1,
    }
    run, calls = _fake_runner(evals, fail={("int8", 1)})
    out = tmp_path / "c"
    rc = converge.main(["schemes=fp,w4g4,w4g4_ef,int8", "seeds=0,1", f"out={out}", *TINY], runner=run)
    assert rc == 1  # one failed run: reported, the others ran, non-zero at the end
    assert len(calls) == 8
    assert "int8 seed 1" in capsys.readouterr().err
    doc = json.loads((out / "converge.json").read_text())
    rows = {r["scheme"]: r for r in doc["rows"]}
    g = [100 * (2.20 / 2.00 - 1), 100 * (2.21 / 2.02 - 1)]
    assert rows["w4g4"]["gap_pct_mean"] == pytest.approx(statistics.fmean(g))
    assert rows["w4g4"]["gap_pct_sd"] == pytest.approx(statistics.stdev(g))
    noise = max(
        statistics.stdev(g), 100 * statistics.stdev([2.0, 2.02]) / 2.01, 100 * statistics.stdev([2.2, 2.21]) / 2.01
    )
    assert rows["w4g4"]["seed_spread_pct"] == pytest.approx(noise)
    assert rows["w4g4"]["outside_seed_spread"] is True  # ~+9.7% against < 1% of seed noise
    assert rows["w4g4_ef"]["gap_pct_mean"] == pytest.approx(statistics.fmean([0.5, 0.0]))
    assert rows["w4g4_ef"]["outside_seed_spread"] is False  # 0.25% inside fp's 0.7% seed sd
    assert rows["w4g4_ef"]["overrides"] == ["quant=w4g4", "zero.grads.error_feedback=true"]
    assert rows["int8"]["seeds"] == [0] and rows["int8"]["failed_seeds"] == [1]
    assert rows["int8"]["gap_pct_mean"] == pytest.approx(5.0) and rows["int8"]["gap_pct_sd"] is None
    assert rows["int8"]["outside_seed_spread"] is None  # one seed: no spread to compare with
    assert rows["fp"]["train_loss_final_mean"] == pytest.approx(2.5)
    assert [r["error"] is not None for r in doc["runs"]].count(True) == 1
    md = (out / "converge.md").read_text()
    assert "Failed runs:" in md and "rank 1 died (int8 1)" in md and "1 (1 failed)" in md
    assert md.count("outside seed spread") == 2  # the w4g4 row and the footnote
    assert "+9.7" in md
    assert (out / "loss.png").exists()


@pytest.mark.parametrize(
    "args, words",
    [
        (["schemes=fp,w9g9"], ["unknown scheme 'w9g9'", "w4g4_ef"]),
        (["seeds=1"], ["seeds", "at least 2"]),
        (["seeds=0"], ["seeds=0"]),
        (["seeds=3,3"], ["distinct"]),
        (["seeds=100000000"], ["seeds=100000000", "at most 100"]),
        (["seeds=" + ",".join(map(str, range(101)))], ["101 seeds", "at most 100"]),
        (["seeds=0,4294967296"], ["[0, 2**32)"]),
        (["seeds=a,b"], ["seeds='a,b'"]),
        (["schemes=w4g4,w4g4h"], ["lacks fp"]),
        (["schemes=fp,fp"], ["repeats fp"]),
        (["quant=int8"], ["'quant=int8'", "schemes="]),
        (["train.seed=4"], ["seeds="]),
        (["--multirun"], ["key=value"]),
        (["model=gigantic"], ["model='gigantic'"]),
        (["train.stepz=3"], ["train.stepz"]),
        (["zero.grads.bits=3"], ["zero.grads"]),
    ],
)
def test_bad_inputs_refused_before_any_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], words: list[str]
) -> None:
    def never(overrides: list[str], run_dir: Path) -> dict[str, Any]:
        raise AssertionError("no run may start on a bad setting")

    schemes = [] if any(a.startswith("schemes=") for a in args) else ["schemes=fp,w4g4"]  # sdp4bit may not exist
    assert converge.main([*schemes, *args, f"out={tmp_path / 'x'}"], runner=never) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    for w in words:
        assert w in err
    assert not (tmp_path / "x").exists()


def test_out_with_runs_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "runs" / "fp" / "seed0").mkdir(parents=True)
    run, calls = _fake_runner({}, set())
    assert converge.main(["schemes=fp,w4g4", f"out={tmp_path}", *TINY], runner=run) == 2
    assert "already holds runs" in capsys.readouterr().err and calls == []


def test_missing_recipe_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """A scheme whose quant recipe this checkout lacks (sdp4bit until it lands) is refused by name."""
    assert "sdp4bit" in converge_suite.DEFAULT_SCHEMES and converge_suite.SCHEMES["sdp4bit"] == ("quant=sdp4bit",)
    monkeypatch.setitem(converge_suite.SCHEMES, "w3g3", ("quant=w3g3",))
    with pytest.raises(ConfigError, match=r"scheme 'w3g3' needs the quant recipe 'w3g3'.*RECIPES"):
        converge_suite.SuiteConfig(schemes=("fp", "w3g3"))
    if "sdp4bit" not in converge_suite.RECIPES:
        with pytest.raises(ConfigError, match="scheme 'sdp4bit' needs the quant recipe 'sdp4bit'"):
            converge_suite.SuiteConfig.from_args([])


def test_defaults_and_override_merge() -> None:
    cfg = converge_suite.SuiteConfig.from_args(["schemes=fp,w4g4", "seeds=3", "model=medium", "optim.lr=1e-3"], now="t")
    assert cfg.seeds == (0, 1, 2) and cfg.out == Path("outputs/converge/t")
    assert "model=small" not in cfg.overrides and "model=medium" in cfg.overrides
    assert "topology=2x2" in cfg.overrides and "data=text" in cfg.overrides
    assert cfg.run_overrides("w4g4", 2)[-2:] == ["quant=w4g4", "train.seed=2"]
    assert converge_suite.scheme_overrides("int8") == ("quant=int8",)  # any recipe is a scheme


def test_an_interrupt_stops_the_suite_and_keeps_the_finished_runs(tmp_path: Path, capsys) -> None:
    """A SIGTERM / Ctrl-C during a run is the suite stopping, not one failed run: no later run
    starts, the command exits 128 + SIGTERM, and the runs finished before are in the tables."""
    run, calls = _fake_runner({("fp", 0): 2.0, ("w4g4", 0): 2.2}, fail=set())

    def stopping(overrides: list[str], run_dir: Path) -> dict[str, Any]:
        if len(calls) == 2:
            calls.append(overrides)
            raise RunInterrupted("interrupted by SIGTERM; all ranks stopped", exit_code=143)
        return run(overrides, run_dir)

    out = tmp_path / "c"
    rc = converge.main(["schemes=fp,w4g4", "seeds=0,1", f"out={out}", *TINY], runner=stopping)
    assert rc == 143 and len(calls) == 3  # fp 0, w4g4 0, then fp 1 interrupted; w4g4 1 never starts
    assert "interrupted by SIGTERM" in capsys.readouterr().err
    rows = {r["scheme"]: r for r in json.loads((out / "converge.json").read_text())["rows"]}
    assert set(rows) == {"fp", "w4g4"}


@pytest.mark.parametrize("scheme", sorted(converge_suite.SCHEMES))
def test_every_named_scheme_composes_to_what_its_name_says(scheme: str) -> None:
    """Each scheme's overrides make a valid run config; ``_h`` rotates the gradients and ``_ef``
    error-feeds them, on top of the recipe the name starts with."""
    suite = converge_suite.SuiteConfig(schemes=tuple(dict.fromkeys(("fp", scheme))))
    cfg = compose_run(suite.run_overrides(scheme, 0))
    recipe = converge_suite.scheme_overrides(scheme)[0].split("=", 1)[1]
    base = converge_suite.RECIPES[recipe].grads
    if base is None:
        assert cfg.zero.grads is None and scheme == "fp"
        return
    assert cfg.zero.grads is not None
    assert cfg.zero.grads.scheme == base.scheme and cfg.zero.grads.bits == base.bits
    assert (cfg.zero.grads.rotation == "hadamard") == ("_h" in scheme or base.rotation == "hadamard")
    assert cfg.zero.grads.error_feedback == ("_ef" in scheme or base.error_feedback)


@pytest.mark.parametrize("kind", ["a user's converge.csv", "a file", "unwritable"])
def test_an_out_the_tables_cannot_go_to_is_refused_before_any_run(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: the suite trained, then a user's converge.csv was overwritten, or a FileExistsError /
    FileNotFoundError traceback ended it after its runs."""
    (tmp_path / "converge.csv").write_text("mine")
    out = {"a user's converge.csv": tmp_path, "a file": tmp_path / "converge.csv", "unwritable": Path("/proc/conv")}
    run, calls = _fake_runner({}, set())
    assert converge.main(["schemes=fp,w4g4", f"out={out[kind]}", *TINY], runner=run) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: invalid config: ") and str(out[kind]) in err and calls == []
    assert (tmp_path / "converge.csv").read_text() == "mine"


def test_a_second_suite_into_its_own_tables_replaces_them(tmp_path: Path) -> None:
    evals = {(s, k): 4.0 for s in ("fp", "w4g4") for k in (0, 1)}
    for i in range(2):
        out = tmp_path / f"runs{i}"
        run, _ = _fake_runner(evals, set())
        assert converge.main(["schemes=fp,w4g4", "seeds=0,1", f"out={tmp_path}", *TINY], runner=run) == 0
        (tmp_path / "runs").rename(out)  # a fresh suite needs an out= without runs
    assert json.loads((tmp_path / "converge.json").read_text())["schemes"] == ["fp", "w4g4"]
    assert (tmp_path / "loss.png").read_bytes().startswith(b"\x89PNG")


def test_an_empty_out_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """Before: ``out=`` was the current directory, and the runs landed there."""
    run, calls = _fake_runner({}, set())
    assert converge.main(["schemes=fp,w4g4", "out=", *TINY], runner=run) == 2
    assert "out= is empty; name the output directory" in capsys.readouterr().err and calls == []


def test_runs_this_host_cannot_start_are_refused_before_the_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: every run failed alike (no GPU for ``launcher.device=cuda``) and the suite exited 1."""
    import torch

    from zeropp.experiments.runner import run as runner

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(runner, "run_job", lambda *a, **k: pytest.fail("a run was started"))
    rc = converge.main(["schemes=fp,w4g4", f"out={tmp_path / 'c'}", "launcher.device=cuda", *TINY])
    assert rc == 2 and "launcher.device=cuda starts 2 ranks on this host but it has 0 GPU(s)" in capsys.readouterr().err
