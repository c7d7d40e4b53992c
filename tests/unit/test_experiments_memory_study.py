"""``python -m experiments.memory_study``: the per-phase memory study of a plain MLP, at a tiny size.

Here: the one-process checks. The topic's full description and its end-to-end checks are in
``tests/e2e/test_experiments_memory_study.py``.
"""

from __future__ import annotations

import pytest

from zeropp.experiments.studies import memory_study as ms


def test_bf16_formulas_are_the_papers() -> None:
    cfg = ms.StudyConfig(precision="bf16")
    texts = [(ms.formula_text(cfg, z, "device"), ms.formula_text(cfg, z, "host")) for _, z in ms.CONFIGS]
    # 2-byte weights and gradients + 12 bytes of fp32 master, m, v; offload: 2Ψ/N params + 12Ψ/N + 4Ψ/N fp32 grads
    assert texts == [("16Ψ", "0"), ("4Ψ + 12Ψ/N", "0"), ("2Ψ + 14Ψ/N", "0"), ("16Ψ/N", "0"), ("2Ψ/N", "18Ψ/N")]


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--width", "0"], "width=0"),
        (["--precision", "fp16"], "precision='fp16'"),
        (["--tolerance", "1.5"], "tolerance=1.5"),
    ],
)
def test_bad_options_are_refused_before_any_rank_starts(argv, says, monkeypatch, capsys, tmp_path) -> None:
    monkeypatch.setattr(ms, "run_study", lambda cfg: pytest.fail("a rank was started"))
    with pytest.raises(SystemExit) as e:
        ms.main([*argv, "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: invalid config: ") and says in err, err


def test_an_out_dir_that_cannot_be_created_is_refused(monkeypatch, capsys, tmp_path) -> None:
    monkeypatch.setattr(ms, "run_study", lambda cfg: pytest.fail("a rank was started"))
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(SystemExit) as e:
        ms.main(["--out", str(blocker / "study")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "cannot be created" in err and "a_file/study" in err, err
    assert blocker.read_text() == "not a directory"  # untouched


def test_files_of_the_users_in_out_are_refused_and_its_own_replaced(monkeypatch, capsys, tmp_path) -> None:
    """Before: a memory_study.png of the user's in --out was overwritten after the study."""
    monkeypatch.setattr(ms, "run_study", lambda cfg: pytest.fail("a rank was started"))
    (tmp_path / "memory_study.png").write_text("mine")
    with pytest.raises(SystemExit) as e:
        ms.main(["--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "holds memory_study.png, which this command would overwrite" in err, err
    assert (tmp_path / "memory_study.png").read_text() == "mine"
    ms.write_outputs(tmp_path / "own", {name: b"earlier" for name in ms.OUTPUTS})
    ms._prepare_out(tmp_path / "own")  # an earlier study's files: accepted, to be replaced


def test_an_interrupted_study_is_not_reported_as_failed_ranks(monkeypatch, tmp_path) -> None:
    """Ctrl-C reaches the command (experiments/launch/command.py: exit 130), not exit 1."""
    from zeropp.experiments.launch import RunInterrupted

    def stopped(cfg):
        raise RunInterrupted("interrupted by SIGINT; all ranks stopped", exit_code=130)

    monkeypatch.setattr(ms, "run_study", stopped)
    with pytest.raises(RunInterrupted):
        ms.main(["--out", str(tmp_path)])


def test_a_model_beyond_host_memory_is_refused_before_any_rank(monkeypatch, capsys, tmp_path) -> None:
    """Before: each rank died allocating it, with the allocator's traceback."""
    monkeypatch.setattr(ms, "run_study", lambda cfg: pytest.fail("a rank was started"))
    monkeypatch.setattr(ms, "host_memory", lambda: 1 << 30)
    with pytest.raises(SystemExit) as e:
        ms.main(["--width", "4096", "--layers", "4", "--world", "2", "--out", str(tmp_path / "s")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "its stage-0 baseline needs about 2.00 GiB on 2 ranks" in err, err
    assert not (tmp_path / "s").exists()
