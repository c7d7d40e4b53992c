"""``scripts/gpu_check.sh``, the one-command GPU acceptance, on a machine without a GPU: one line
saying why, exit 0, nothing written; a Python that cannot import torch is an error, not a skip.
(The GPU path runs the cuda tier and the benchmarks; it is exercised on a GPU machine.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"


def _run(tmp_path: Path, python: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=python, OUT=str(tmp_path / "out"), CUDA_VISIBLE_DEVICES="")  # no GPU, even on one
    return subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "report.md")], env=env, capture_output=True, text=True, timeout=120
    )


def test_without_a_gpu_it_skips_in_one_line_and_writes_nothing(tmp_path):
    proc = _run(tmp_path, sys.executable)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == [proc.stdout.strip()] and proc.stderr == ""
    assert proc.stdout.startswith("gpu_check: skipped: no CUDA device visible to torch"), proc.stdout
    assert os.listdir(tmp_path) == []


def test_a_python_without_torch_is_an_error_not_a_skip(tmp_path):
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\nexec "$0.real" -S -I "$@"\n')  # -I -S: no site-packages, so no torch
    fake.chmod(0o755)
    (tmp_path / "python.real").symlink_to(sys.executable)
    proc = _run(tmp_path, str(fake))
    assert proc.returncode == 1 and proc.stdout == "", proc.stdout + proc.stderr
    assert "cannot import torch" in proc.stderr and "set PYTHON" in proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["python", "python.real"]


def test_the_script_parses():
    proc = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


def test_the_reports_python_snippets_compile():
    """The report's inline Python runs only on a GPU machine: at least make sure it is valid Python
    on the oldest supported version (no backslashes inside f-string expressions, say)."""
    import re

    snippets = re.findall(r"\"\$PY\" -c '\n([^']*)'", SCRIPT.read_text())  # bash-quoted: no ' inside
    assert len(snippets) >= 2, "the inline Python of the report was not found"
    for code in snippets:
        compile(code, "gpu_check.sh", "exec")
