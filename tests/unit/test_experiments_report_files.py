"""``python -m experiments.report`` overwrites only its own files, and bad input exits 2 naming it.

The sweeps are two hand-written ``summary.json`` files with the keys the table and figures read
(no rank runs). A file is the report's own while ``report-manifest.json`` lists it with its current
size and sha256; anything else in the way refuses the whole report before a byte is written.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from zeropp.experiments.studies import report_files
from zeropp.experiments.studies.report import PLOTS, REPORT, main, write_report
from zeropp.experiments.studies.report_files import MANIFEST

OUTPUTS = (REPORT, *PLOTS, MANIFEST)


def _sweep(root: Path, tokens_per_s: float = 1000.0) -> Path:
    """A two-job multirun under ``root`` (jobs ``0`` and ``1``, seeds 0 and 1); returns ``root``."""
    for i in (0, 1):
        d = root / str(i)
        d.mkdir(parents=True, exist_ok=True)
        summary = {
            "label": f"run{i}",
            "tokens_per_s": tokens_per_s * (i + 1),
            "step_time_s": {"mean": 0.1},
            "model_tflops": 0.01,
            "comm_bytes_per_step": {"by_link": {"intra": 1024, "cross": 0}},
            "comm_wait_s_per_step": 0.001,
            "memory_max_rank_bytes": 2**20,
            "memory_per_rank": [{"params": 2**20, "total": 2**20}],
            "loss": {"final": 3.0, "curve": [5.0, 4.0, 3.0]},
            "overrides": [f"train.seed={i}"],
            "config": {"train": {"seed": i}},
        }
        (d / "summary.json").write_text(json.dumps(summary))
    return root


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one-line error of a report that exits 2."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


@pytest.fixture(scope="module")
def reported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """The files of one report of :func:`_sweep` (drawn once; tests copy them)."""
    root = _sweep(tmp_path_factory.mktemp("reported"))
    write_report(root)
    return {n: (root / n).read_bytes() for n in OUTPUTS}


def _with_report(root: Path, files: dict[str, bytes]) -> Path:
    for n, data in files.items():
        (root / n).write_bytes(data)
    return root


def test_user_files_with_the_reports_names_survive_and_nothing_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _sweep(tmp_path)
    (root / REPORT).write_text("notes\n")
    (root / "loss.png").write_text("x\n")
    before = _files(root)
    err = _refused([str(root)], capsys)
    assert "report.md" in err and "loss.png" in err and "--out" in err and "throughput.png" not in err
    assert _files(root) == before  # the two files as they were, no figure, no manifest


def test_a_second_report_overwrites_its_own_outputs(tmp_path: Path, reported: dict[str, bytes]) -> None:
    root = _with_report(_sweep(tmp_path), reported)
    (root / "notes.txt").write_text("mine\n")  # another file, not in the report's way
    _sweep(root, tokens_per_s=7777.0)  # the runs changed since: the report's content changes too
    write_report(root)
    md = (root / REPORT).read_text()
    assert "7,777" in md and md.encode() != reported[REPORT]
    assert (root / "notes.txt").read_text() == "mine\n"
    manifest = json.loads((root / MANIFEST).read_text())
    listed = {f["name"]: f for f in manifest["files"]}
    assert sorted(listed) == sorted((REPORT, *PLOTS))
    for name, f in listed.items():
        assert f["size"] == (root / name).stat().st_size
    assert not [p for p in root.iterdir() if p.name.endswith(".tmp")]


def test_an_out_dir_is_created_and_a_report_there_is_rewritten(tmp_path: Path) -> None:
    root = _sweep(tmp_path / "sweep")
    out = tmp_path / "new" / "out"
    write_report(root, out)
    first = _files(out)
    assert sorted(first) == sorted(OUTPUTS) and not (root / REPORT).exists()
    write_report(root, out)
    assert _files(out)[REPORT] == first[REPORT]


def test_an_own_output_the_user_edited_is_theirs_now(
    tmp_path: Path, reported: dict[str, bytes], capsys: pytest.CaptureFixture[str]
) -> None:
    root = _with_report(_sweep(tmp_path), reported)
    (root / REPORT).write_bytes(reported[REPORT] + b"\nmy conclusions\n")
    (root / "memory.png").write_bytes(reported["memory.png"][:-1] + b"\0")  # same size, other bytes
    before = _files(root)
    err = _refused([str(root)], capsys)
    assert "report.md, memory.png" in err and "loss.png" not in err
    assert _files(root) == before


def test_a_link_named_like_an_output_is_not_the_reports(
    tmp_path: Path, reported: dict[str, bytes], capsys: pytest.CaptureFixture[str]
) -> None:
    """Even one to a file with the listed content: the report writes files, never links."""
    root = _with_report(_sweep(tmp_path / "sweep"), reported)
    (tmp_path / "elsewhere.png").write_bytes(reported["loss.png"])
    (root / "loss.png").unlink()
    (root / "loss.png").symlink_to(tmp_path / "elsewhere.png")
    assert "loss.png" in _refused([str(root)], capsys)
    assert (root / "loss.png").is_symlink()


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        "[]",
        '{"files": []}',
        '{"format": "zeropp-report-manifest/1", "files": {}}',
        '{"format": "zeropp-report-manifest/1", "files": [{"name": "report.md", "size": "1", "sha256": "x"}]}',
        '{"format": "zeropp-report-manifest/1", "files": [{"name": "../x", "size": 1, "sha256": "' + "0" * 64 + '"}]}',
        b"\xff\xfe".decode("latin-1"),
    ],
)
def test_a_malformed_manifest_is_not_trusted(
    tmp_path: Path, reported: dict[str, bytes], capsys: pytest.CaptureFixture[str], text: str
) -> None:
    root = _with_report(_sweep(tmp_path), reported)
    (root / MANIFEST).write_bytes(text.encode("latin-1"))
    before = _files(root)
    err = _refused([str(root)], capsys)
    assert f"{root / MANIFEST} is not a manifest written by a report" in err and "--out" in err
    assert _files(root) == before


@pytest.mark.parametrize(
    "name, text, words",
    [
        ("0/summary.json", '{"label": ', "Expecting value"),
        ("1/summary.json", "[1, 2]", "not an object"),
        ("1/summary.json", '{"label": "x"}', "has no tokens_per_s"),
        ("1/metrics.jsonl", '{"step": 1, "loss": 2.0}\n{"step": 2', "metrics.jsonl"),
        ("1/failed.json", '{"overrides": "x"}', '"overrides" list'),
    ],
)
def test_a_malformed_run_file_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, text: str, words: str
) -> None:
    root = _sweep(tmp_path)
    (root / name).write_text(text)
    err = _refused([str(root)], capsys)
    assert str(root / name) in err and words in err
    assert not any((root / n).exists() for n in OUTPUTS)


def test_out_naming_a_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _sweep(tmp_path / "sweep")
    (tmp_path / "out").write_text("mine\n")
    err = _refused([str(root), "--out", str(tmp_path / "out")], capsys)
    assert f"--out {tmp_path / 'out'} exists and is not a directory" in err
    assert (tmp_path / "out").read_text() == "mine\n"
    assert f"{tmp_path / 'out'} is not a directory" in _refused([str(tmp_path / "out")], capsys)  # as the root


def test_an_interrupted_report_leaves_whole_files_that_are_still_its_own(
    tmp_path: Path, reported: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped after the manifest and two of the files were replaced: every file is whole (old or
    new), no temporary file is left, and the next report may overwrite them all."""
    root = _with_report(_sweep(tmp_path), reported)
    _sweep(root, tokens_per_s=7777.0)
    real, calls = os.replace, []

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        calls.append(dst)
        if len(calls) == 4:
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr(report_files.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        write_report(root)
    monkeypatch.setattr(report_files.os, "replace", real)
    files = _files(root)
    assert "7,777" in (root / REPORT).read_text()  # the new report.md, written first
    assert files["loss.png"] == reported["loss.png"]  # the old figure, written last
    assert not [n for n in files if n.endswith(".tmp")]
    write_report(root)
    assert "7,777" in (root / REPORT).read_text()


def test_a_diverged_run_is_a_row_marked_so_with_no_final_loss(tmp_path: Path) -> None:
    """A sweep point that diverged leaves a summary whose final loss is null (NaN is not JSON): its
    row says so and shows ``-`` for the missing figures, and the figures are still drawn (before:
    a TypeError from the table)."""
    root = _sweep(tmp_path)
    s = json.loads((root / "1" / "summary.json").read_text())
    s.update(status="diverged", steps=2, loss={"first": 5.0, "final": None, "eval": None, "curve": [5.0, None]})
    (root / "1" / "summary.json").write_text(json.dumps(s))
    write_report(root)
    md = (root / REPORT).read_text()
    row = next(line for line in md.splitlines() if "run1" in line)
    assert "run1 (diverged at step 2)" in row and row.rstrip().endswith("| - | - |"), row
    assert all((root / p).stat().st_size > 0 for p in PLOTS)


def test_a_resumed_run_that_diverged_names_the_training_step(tmp_path: Path) -> None:
    """A run resumed at step 5 that diverged at step 6 ran 2 steps in that launch: its row names
    step 6, the divergence record's (before: "diverged at step 2", the count of the launch's steps)."""
    root = _sweep(tmp_path)
    s = json.loads((root / "1" / "summary.json").read_text())
    s.update(status="diverged", steps=2, first_step=5, divergence={"step": 6, "reason": "non_finite"})
    s["loss"] = {"first": 5.0, "final": None, "eval": None, "curve": [5.0, None]}
    (root / "1" / "summary.json").write_text(json.dumps(s))
    md = write_report(root).read_text()
    assert "run1 (diverged at step 6)" in md, md
    del s["divergence"]
    (root / "1" / "summary.json").write_text(json.dumps(s))
    assert "run1 (diverged at step 6)" in write_report(root).read_text()  # first_step + steps - 1


def test_failed_and_interrupted_jobs_are_counted_once_and_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A diverged job (summary and ``failed.json``) is a row, not also counted as a job left out; a
    failed job without a summary is counted as left out; a job that started (``ranks/spec.json``)
    but left neither file (Ctrl-C, SIGTERM) is counted and listed with its overrides (before: it
    was silently absent, and the diverged row was also counted as "not in the table")."""
    root = _sweep(tmp_path / "sweep")
    s = json.loads((root / "1" / "summary.json").read_text())
    s.update(status="diverged", steps=2, loss={"first": 5.0, "final": None, "eval": None, "curve": [5.0, None]})
    (root / "1" / "summary.json").write_text(json.dumps(s))
    failed = {"overrides": ["train.seed=1"], "error": "training diverged at step 2", "exit_code": 3}
    (root / "1" / "failed.json").write_text(json.dumps(failed))
    (root / "2").mkdir()
    failed = {"overrides": ["train.seed=2"], "error": "rank 1 (node 0) was killed by SIGKILL", "exit_code": 137}
    (root / "2" / "failed.json").write_text(json.dumps(failed))
    (root / "3" / "ranks").mkdir(parents=True)
    (root / "3" / "ranks" / "spec.json").write_text(json.dumps({"overrides": ["train.seed=3"]}))
    (root / "3" / "metrics.jsonl").write_text('{"step": 1}\n')
    md = write_report(root).read_text()
    assert "2 runs, 1 failed (not in the table or plots), 1 interrupted or still running" in md, md
    assert "- `train.seed=2`: rank 1 (node 0) was killed by SIGKILL" in md
    assert "- `train.seed=1`: training diverged at step 2" in md
    assert "Interrupted or still running" in md and "- `3`, `train.seed=3`" in md
    empty = tmp_path / "none"
    for i in (0, 1):
        (empty / str(i)).mkdir(parents=True)
    (empty / "0" / "failed.json").write_text(json.dumps(failed))
    (empty / "1" / "ranks").mkdir()
    (empty / "1" / "ranks" / "spec.json").write_text("{}")
    err = _refused([str(empty)], capsys)
    assert "its jobs did not finish (1 failed, 1 interrupted or still running" in err, err


def test_one_run_is_counted_in_the_singular(tmp_path: Path) -> None:
    root = _sweep(tmp_path)
    shutil.rmtree(root / "1")
    md = write_report(root).read_text()
    assert "\n1 run." in md, md
