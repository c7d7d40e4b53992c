"""Ctrl-C or SIGTERM while one of our ``python -m`` commands still imports: one line and death by
that signal, even where an import swallows exceptions (torch's C-level import of numpy does); a
lazy import later, and a user's own script, keep Python's ``KeyboardInterrupt`` (and SIGTERM's
silent default); a rank that its launcher reports for stops without the line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from zeropp.interrupts import LAUNCHED_MARK, run_as_module

REPO = Path(__file__).resolve().parents[2]

_SWALLOWING = """
import os, signal, time
try:  # as a C-level import that clears any error: an exception raised here is lost
    os.kill(os.getpid(), signal.SIG{sig})
    time.sleep(5)
except BaseException:
    print("swallowed")
print("imported")
"""

_PLAIN = """
import os, signal, time
os.kill(os.getpid(), signal.SIG{sig})
time.sleep(5)
print("imported")
"""


def _run(
    tmp_path: Path,
    body: str,
    *,
    module: str | None = "experiments.fake",
    sig: str = "INT",
    env: dict[str, str] | None = None,
    timeout: float = 60,
) -> subprocess.CompletedProcess[str]:
    """``body`` in a child whose command line reads ``python -m module`` (None: ``python -c``), after
    ``import zeropp`` and our ``experiments`` package's own call (``__init__``). Its modules
    ``swallowing`` and ``plain`` send the process ``SIG<sig>`` while they are imported. ``env``:
    added to the child's environment (which has no ``RANK`` unless given); ``timeout``: seconds
    before the child counts as hung (``subprocess.TimeoutExpired``)."""
    (tmp_path / "swallowing.py").write_text(_SWALLOWING.format(sig=sig))
    (tmp_path / "plain.py").write_text(_PLAIN.format(sig=sig))
    child_env = {k: v for k, v in os.environ.items() if k not in ("RANK", LAUNCHED_MARK)}
    prelude = (
        "import sys\n"
        + (f"sys.orig_argv = [sys.executable, '-m', {module!r}]\n" if module else "")
        + f"sys.path.insert(0, {str(tmp_path)!r})\n"
        + "import zeropp.interrupts\n"
        + "zeropp.interrupts.quiet_interrupts_while_importing('experiments')\n"
    )
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(body)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**child_env, **(env or {})},
    )


def test_an_interrupt_during_start_up_imports_is_one_line_and_death_by_sigint(tmp_path: Path) -> None:
    p = _run(tmp_path, "import swallowing\nprint('ran on')\n")
    assert p.returncode == -signal.SIGINT, (p.returncode, p.stdout, p.stderr)  # a shell shows 130
    assert p.stderr == "error: interrupted by SIGINT while starting; stopped\n"
    assert p.stdout == ""  # neither swallowed nor run on


def test_a_sigterm_during_start_up_imports_is_one_line_and_death_by_sigterm(tmp_path: Path) -> None:
    """SIGTERM (``timeout``, ``kill``) in the first seconds ended the command with no word (the
    kernel's default); now as Ctrl-C: one line, and still death by SIGTERM (the shell shows 143)."""
    p = _run(tmp_path, "import swallowing\nprint('ran on')\n", sig="TERM")
    assert p.returncode == -signal.SIGTERM, (p.returncode, p.stdout, p.stderr)
    assert p.stderr == "error: interrupted by SIGTERM while starting; stopped\n"
    assert p.stdout == ""


def test_a_sigterm_after_the_imports_before_the_commands_handler_is_one_line(tmp_path: Path) -> None:
    """Between the imports and the command's own SIGTERM handler (``sigterm_raises``) the default
    disposition would end the process silently too: the line without "while starting"."""
    p = _run(
        tmp_path, "import os, signal, time\nos.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(5)\nprint('ran on')\n"
    )
    assert (p.returncode, p.stdout, p.stderr) == (-signal.SIGTERM, "", "error: interrupted by SIGTERM; stopped\n")


_C_WAIT = """
import ctypes, os, signal, threading
threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
mutex = ctypes.create_string_buffer(64)  # a default pthread mutex, locked twice by this thread:
libc = ctypes.CDLL(None)                 # a wait in C that goes on through signals (as gloo's do)
libc.pthread_mutex_lock(mutex)
libc.pthread_mutex_lock(mutex)
print("ran on")
"""


def test_a_sigterm_while_the_command_waits_in_c_after_its_handler_ends_the_process(tmp_path: Path) -> None:
    """Once the command's own handling began (``sigterm_raises``, as ``run_command`` and the runner
    use it) and ended, SIGTERM has its default disposition again, not the start-up stand-in: a
    Python-level handler runs only between bytecodes, so a main thread waiting in C (a collective,
    the interpreter's shutdown) held the process until that wait ended (here: never)."""
    body = "from zeropp.experiments.launch.command import sigterm_raises\nwith sigterm_raises():\n    pass\n"
    p = _run(tmp_path, body + _C_WAIT, timeout=30)
    assert (p.returncode, p.stdout) == (-signal.SIGTERM, ""), (p.returncode, p.stdout, p.stderr)  # a shell shows 143


def test_a_doctor_rank_waiting_in_its_rendezvous_ends_at_once_on_sigterm(tmp_path: Path) -> None:
    """A real entry point: ``python -m zeropp.doctor.rank`` (rank 0 of 2, its peer never comes) waits
    in torch's rendezvous, in C; a SIGTERM there ends it by the signal (before: the start-up stand-in,
    still installed, waited for the rendezvous's timeout)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", LAUNCHED_MARK)}
    env.update(
        RANK="0",
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        ZEROPP_DOCTOR_BACKEND="gloo",
        ZEROPP_DOCTOR_TIMEOUT_S="120",
    )
    p = subprocess.Popen(
        [sys.executable, "-m", "zeropp.doctor.rank"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
    )
    try:
        assert p.stdout is not None and '"started"' in p.stdout.readline()
        stat = Path(f"/proc/{p.pid}/task/{p.pid}/stat")
        for _ in range(600):  # until the main thread sleeps in the rendezvous (nothing else runs after "started")
            if stat.read_text().rsplit(")", 1)[1].split()[0] == "S":
                break
            time.sleep(0.05)
        time.sleep(0.5)
        p.send_signal(signal.SIGTERM)
        code = p.wait(timeout=30)
    finally:
        p.kill()
        p.wait()
    assert code == -signal.SIGTERM, (code, p.stderr.read() if p.stderr else "")


@pytest.mark.parametrize("sig", ["INT", "TERM"])
@pytest.mark.parametrize("env", [{"RANK": "1"}, {"RANK": "0", LAUNCHED_MARK: "0"}])
def test_a_rank_its_launcher_reports_for_stops_without_the_line(tmp_path: Path, sig: str, env: dict[str, str]) -> None:
    """A torchrun rank other than 0, or any rank of our launcher (which says ``all ranks stopped``
    once): the same death by the signal, without a line of its own (one per rank, before)."""
    p = _run(tmp_path, "import swallowing\nprint('ran on')\n", sig=sig, env=env)
    assert (p.returncode, p.stdout, p.stderr) == (-getattr(signal, f"SIG{sig}"), "", "")
    torchrun_rank0 = _run(tmp_path, "import swallowing\n", sig=sig, env={"RANK": "0"})  # says it, once per job
    assert torchrun_rank0.stderr == f"error: interrupted by SIG{sig} while starting; stopped\n"


def test_a_forked_child_keeps_the_default_sigterm(tmp_path: Path) -> None:
    """A child forked after the imports (a data loader's worker) inherits the handler: a SIGTERM
    there ends it silently, as the default disposition does; the line is the command's alone."""
    body = (
        "import os, signal, time\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(5)\n"
        "    os._exit(0)\n"
        "print(os.waitpid(pid, 0)[1] == signal.SIGTERM)\n"
    )
    p = _run(tmp_path, body)
    assert (p.returncode, p.stdout, p.stderr) == (0, "True\n", "")


@pytest.mark.parametrize("module", [None, "mytool.train", "experimentsx.run"])
def test_a_lazy_import_and_a_users_script_keep_keyboard_interrupt(tmp_path: Path, module: str | None) -> None:
    lazy = _run(tmp_path, "def f():\n    import plain\ntry:\n    f()\nexcept KeyboardInterrupt:\n    print('KI')\n")
    assert (lazy.returncode, lazy.stdout) == (0, "KI\n"), lazy.stderr
    users = _run(tmp_path, "import swallowing\nprint('ran on')\n", module=module)  # Python's own handler
    assert (users.returncode, users.stdout) == (0, "swallowed\nimported\nran on\n"), users.stderr
    if module is not None:  # a user's SIGTERM: the kernel's default, no line of ours
        term = _run(tmp_path, "import swallowing\nprint('ran on')\n", module=module, sig="TERM")
        assert (term.returncode, term.stdout, term.stderr) == (-signal.SIGTERM, "", "")


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
