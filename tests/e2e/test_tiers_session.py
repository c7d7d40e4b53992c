"""A test module left outside the tiers stops ``pytest`` with one line saying where to move it,
instead of being silently skipped by ``testpaths`` (a real session on a crafted tree)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import TESTS


def test_a_stray_test_module_stops_the_session_naming_it(tmp_path: Path) -> None:
    shutil.copy(TESTS.parent / "pyproject.toml", tmp_path / "pyproject.toml")
    tests = tmp_path / "tests"
    (tests / "unit").mkdir(parents=True)
    for helper in ("conftest.py", "cache_warmers.py"):  # the session's hooks and the module they import
        shutil.copy(TESTS / helper, tests / helper)
    for init in (tests / "__init__.py", tests / "unit" / "__init__.py"):
        init.write_text("")
    (tests / "unit" / "test_ok.py").write_text("def test_ok():\n    pass\n")
    (tests / "test_stray.py").write_text("def test_never_collected():\n    pass\n")
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 4, p.stdout + p.stderr  # pytest's usage error
    out = p.stdout + p.stderr
    assert "tests/test_stray.py: a test module outside the tiers is never collected" in out, out
    assert "move it into tests/{unit,distributed,e2e,gpu}/" in out, out
    (tests / "test_stray.py").unlink()
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "unit"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0 and "1 passed" in p.stdout, p.stdout + p.stderr  # placed: collected and marked
