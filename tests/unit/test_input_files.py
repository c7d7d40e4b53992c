"""Files a command is pointed at (zeropp/input_files.py): a FIFO, a device, a directory or an
oversized file is refused with what the path is, at once; before, a FIFO named as a cluster file,
a ``summary.json`` or a ``metrics.jsonl`` blocked the command forever and ``/dev/zero`` never ended."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, Callable

import pytest

from zeropp.experiments.projection import scaling_check
from zeropp.experiments.projection.cluster_file import ClusterFileError, read_cluster_file
from zeropp.experiments.runner.metrics import read_metrics
from zeropp.experiments.studies.report import ReportError, load_runs
from zeropp.input_files import read_regular


def _within(fn: Callable[[], Any], seconds: float = 20) -> BaseException | None:
    """Run ``fn`` in a daemon thread; the exception it raised (None if it returned), failing the
    test when it is still running after ``seconds`` (blocked: the defect)."""
    box: list[BaseException | None] = []

    def body() -> None:
        try:
            fn()
            box.append(None)
        except BaseException as e:  # handed to the test
            box.append(e)

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "blocked reading the path"
    return box[0]


def test_what_is_not_a_regular_file_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, words in [
        (fifo, "is a FIFO (named pipe), not a regular file"),
        (Path("/dev/zero"), "is a character device, not a regular file"),
        (tmp_path, "is a directory, not a regular file"),
    ]:
        e = _within(lambda p=path: read_regular(p))
        assert isinstance(e, OSError) and words in str(e)
    big = tmp_path / "big"
    big.write_bytes(b"x" * 101)
    with pytest.raises(OSError, match="holds 101 bytes, more than the 100 read here"):
        read_regular(big, limit=100)
    assert read_regular(big) == b"x" * 101


def test_commands_refuse_a_fifo_instead_of_blocking(tmp_path: Path, capsys) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    e = _within(lambda: read_cluster_file(fifo))
    assert isinstance(e, ClusterFileError) and "is a FIFO (named pipe), not a regular file" in str(e)
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    (run / "summary.json").symlink_to(fifo)
    e = _within(lambda: load_runs(tmp_path / "runs"))
    assert isinstance(e, ReportError) and "summary.json" in str(e) and "FIFO" in str(e)
    e = _within(lambda: scaling_check.main([str(tmp_path / "runs")]))
    assert isinstance(e, SystemExit) and e.code == 2 and "FIFO" in capsys.readouterr().err
    (run / "summary.json").unlink()
    (run / "summary.json").write_text(json.dumps({"label": "x"}))
    (run / "metrics.jsonl").symlink_to(fifo)
    e = _within(lambda: read_metrics(run / "metrics.jsonl"))
    assert isinstance(e, OSError) and "FIFO" in str(e)
    assert read_metrics(run / "missing.jsonl") == []


def test_a_deeply_nested_json_file_is_one_error_not_a_recursion_traceback(tmp_path: Path, capsys) -> None:
    """``[[[[...`` 100000 deep as a cluster file, a summary.json or a metrics line: each reader
    reports it as malformed JSON naming the file (before: ``RecursionError`` traceback, exit 1)."""
    deep = "[" * 100_000 + "]" * 100_000
    cf = tmp_path / "c.json"
    cf.write_text(deep)
    with pytest.raises(ClusterFileError, match="c.json is not JSON .*nested too deeply"):
        read_cluster_file(cf)
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(deep)
    with pytest.raises(ReportError, match="summary.json: nested too deeply"):
        load_runs(tmp_path / "runs")
    with pytest.raises(SystemExit) as e:
        scaling_check.main([str(tmp_path / "runs")])
    assert e.value.code == 2 and "nested too deeply" in capsys.readouterr().err
    (run / "metrics.jsonl").write_text(deep + "\n")
    with pytest.raises(ValueError, match="nested too deeply"):
        read_metrics(run / "metrics.jsonl")
