"""Ctrl-C while one of our ``python -m`` commands still imports: one line and death by SIGINT, even
where an import swallows exceptions (torch's C-level import of numpy does); a lazy import later,
and a user's own script, keep Python's ``KeyboardInterrupt``."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from zeropp.interrupts import run_as_module

REPO = Path(__file__).resolve().parents[2]

_SWALLOWING = """
import os, signal, time
try:  # as a C-level import that clears any error: an exception raised here is lost
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)
except BaseException:
    print("swallowed")
print("imported")
"""

_PLAIN = """
import os, signal, time
os.kill(os.getpid(), signal.SIGINT)
time.sleep(5)
print("imported")
"""


def _run(tmp_path: Path, body: str, *, module: str | None = "experiments.fake") -> subprocess.CompletedProcess[str]:
    """``body`` in a child whose command line reads ``python -m module`` (None: ``python -c``), after
    ``import zeropp`` and our ``experiments`` package's own call (``__init__``)."""
    (tmp_path / "swallowing.py").write_text(_SWALLOWING)
    (tmp_path / "plain.py").write_text(_PLAIN)
    prelude = (
        "import sys\n"
        + (f"sys.orig_argv = [sys.executable, '-m', {module!r}]\n" if module else "")
        + f"sys.path.insert(0, {str(tmp_path)!r})\n"
        + "import zeropp.interrupts\n"
        + "zeropp.interrupts.quiet_interrupts_while_importing('experiments')\n"
    )
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(body)], capture_output=True, text=True, timeout=60, cwd=REPO
    )


def test_an_interrupt_during_start_up_imports_is_one_line_and_death_by_sigint(tmp_path: Path) -> None:
    p = _run(tmp_path, "import swallowing\nprint('ran on')\n")
    assert p.returncode == -signal.SIGINT, (p.returncode, p.stdout, p.stderr)  # a shell shows 130
    assert p.stderr == "error: interrupted by SIGINT while starting; stopped\n"
    assert p.stdout == ""  # neither swallowed nor run on


@pytest.mark.parametrize("module", [None, "mytool.train", "experimentsx.run"])
def test_a_lazy_import_and_a_users_script_keep_keyboard_interrupt(tmp_path: Path, module: str | None) -> None:
    lazy = _run(tmp_path, "def f():\n    import plain\ntry:\n    f()\nexcept KeyboardInterrupt:\n    print('KI')\n")
    assert (lazy.returncode, lazy.stdout) == (0, "KI\n"), lazy.stderr
    users = _run(tmp_path, "import swallowing\nprint('ran on')\n", module=module)  # Python's own handler
    assert (users.returncode, users.stdout) == (0, "swallowed\nimported\nran on\n"), users.stderr


def test_a_users_own_experiments_package_importing_zeropp_keeps_pythons_handler(tmp_path: Path) -> None:
    """zeropp's ``__init__`` installs the handler for ``python -m zeropp.X`` only: a user's
    ``python -m experiments.train`` (a package of theirs with our package's common name) that
    imports zeropp keeps Python's handler (asyncio.run, for one, checks for it)."""
    code = (
        "import sys, signal\n"
        "sys.orig_argv = [sys.executable, '-m', 'experiments.train']\n"
        "import zeropp\n"
        "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert (p.returncode, p.stdout) == (0, "True\n"), p.stderr


@pytest.mark.parametrize(
    "argv, module",
    [
        (["py", "-m", "experiments.run", "stage=3"], "experiments.run"),
        (["py", "-mzeropp.doctor"], "zeropp.doctor"),
        (["py", "-X", "importtime", "-W", "ignore", "-u", "-m", "experiments.bench_peers"], "experiments.bench_peers"),
        (["py", "-c", "import x", "-m", "experiments.run"], None),
        (["py", "script.py", "-m", "experiments.run"], None),
        (["py"], None),
        (["py", "-m"], None),
    ],
)
def test_the_module_of_the_interpreters_command_line(argv: list[str], module: str | None) -> None:
    assert run_as_module(argv) == module
