"""The compile-cache warmers (``tests/cache_warmers.py``): which start for a selection, that each
one's child selects exactly its group's tests, and that a running warmer is waited for before
its group and stopped with the session."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import cache_warmers
from tests.cache_warmers import ENV, WARMERS, Running, Warmer, to_start

COMPILED = "tests/e2e/test_kernels.py::test_compiled_cpu_requantize_is_bit_identical_to_the_reference[False-4-8]"
TRITON = "tests/e2e/test_kernels_triton.py::test_kernels_compile_for_h100_without_fp_contraction_or_ftz"
UNIT = "tests/unit/test_tiers.py::test_tier_of_reads_the_folder_under_tests"
PLAIN = "tests/e2e/test_kernels.py::test_native_cpu_build_is_cached_and_keyed"


def test_warmers_start_only_for_selected_groups_after_unit_tests() -> None:
    both = to_start([UNIT, PLAIN, COMPILED, TRITON], ["unit", "e2e", "e2e", "e2e"], None)
    assert [w.file for w in both] == ["tests/e2e/test_kernels.py", "tests/e2e/test_kernels_triton.py"]
    assert to_start([UNIT, PLAIN], ["unit", "e2e"], None) == []  # no group selected
    assert to_start([COMPILED, TRITON], ["e2e", "e2e"], None) == []  # no unit tier to overlap: alone
    assert to_start([COMPILED, UNIT], ["e2e", "unit"], None) == []  # the group runs before the unit tests
    assert to_start([UNIT, COMPILED, TRITON], ["unit", "e2e", "e2e"], "0") == []  # off / a warmer's child
    assert [w.file for w in to_start([UNIT, TRITON], ["unit", "e2e"], "1")] == ["tests/e2e/test_kernels_triton.py"]


def _collect(argv: list[str]) -> list[str]:
    """The test ids ``pytest --collect-only -q`` lists for ``argv`` (no warmers in it)."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *argv],
        cwd=cache_warmers.ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, ENV: "0"},
    )
    return [ln for ln in out.stdout.splitlines() if "::" in ln]


def test_each_warmer_selects_what_its_group_matches() -> None:
    """The child's ``-k`` selects exactly the tests :meth:`Warmer.matches` names (pytest's own
    collection, no test run)."""
    everything = _collect([w.file for w in WARMERS])
    for w in WARMERS:
        argv = w.argv(Path("/nonexistent"))
        assert argv[:3] == [sys.executable, "-m", "pytest"] and w.file in argv
        chosen = _collect([a for a in argv[3:] if a not in ("-q", "-p", "no:cacheprovider") and "basetemp" not in a])
        assert chosen and chosen == [i for i in everything if w.matches(i)], (w.name, chosen)


def test_a_running_warmer_is_waited_for_and_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before its group's first test a warmer still running is waited for; others are not; the
    session's end stops whatever still runs, children included, and removes its folders."""
    slow = tmp_path / "slow.py"
    slow.write_text(
        "import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\ntime.sleep(60)\n"
    )
    quick = tmp_path / "quick.py"
    quick.write_text("import time\ntime.sleep(0.5)\n")
    group = Warmer(name="quick", file="tests/e2e/test_quick.py")
    other = Warmer(name="slow", file="tests/e2e/test_slow.py")
    monkeypatch.setattr(Warmer, "argv", lambda self, basetemp: [sys.executable, str(quick if self is group else slow)])
    running = Running()
    running.start([group, other])
    try:
        assert len(running.temps) == 2 and all(t.is_dir() for t in running.temps)
        running.wait_for("tests/e2e/test_quick.py::test_a")
        assert running.procs[0].returncode == 0  # waited for: it finished
        t0 = time.monotonic()
        running.wait_for("tests/e2e/test_elsewhere.py::test_b")  # not a warmed group: no wait
        assert time.monotonic() - t0 < 5 and running.procs[1].poll() is None
        slow_proc = running.procs[1]
        temps = list(running.temps)
    finally:
        running.stop()
    assert slow_proc.returncode == -9 and not any(t.exists() for t in temps)
    assert running.procs == [] and running.warmers == []
