"""How every ``python -m experiments.X`` command ends (experiments/launch/command.py): an interrupt
(Ctrl-C in this process, or a world of ranks stopped by one) or a failed world is one ``error:``
line and the shell's status, never a traceback; a command's own status passes through. Also each
alias really ends that way, on one real in-process benchmark interrupted by SIGINT."""

from __future__ import annotations

import importlib
import inspect
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zeropp.experiments import launch
from zeropp.experiments.launch.command import run_command

ALIASES = sorted(
    p.stem
    for p in (Path(launch.__file__).parents[1]).glob("*.py")
    if p.stem not in ("__init__", "run", "ring_probe")  # run: the runner's own cli; ring_probe: the cluster room
)


def _end(fn, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        run_command(fn)
    return int(e.value.code or 0), capsys.readouterr().err


def _keyboard() -> None:
    raise KeyboardInterrupt


def _stopped() -> None:
    raise launch.RunInterrupted("interrupted by SIGTERM; all ranks stopped", exit_code=143)


def _failed() -> None:
    raise launch.RankFailure("rank 1 exited with code 3", rank=1, exit_code=3)


def _sigterm() -> None:
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, signal.SIG_IGN):  # it would end this test process
        raise AssertionError("run_command installs no SIGTERM handler")
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)  # the handler raises here
    raise AssertionError("SIGTERM did not unwind the command")


def test_interrupts_and_failures_are_one_line(capsys) -> None:
    assert _end(_keyboard, capsys) == (130, "error: interrupted by SIGINT; stopped\n")
    before = signal.getsignal(signal.SIGTERM)
    assert _end(_sigterm, capsys) == (143, "error: interrupted by SIGTERM; stopped\n")
    assert signal.getsignal(signal.SIGTERM) is before  # restored after the command
    assert _end(_stopped, capsys) == (143, "error: interrupted by SIGTERM; all ranks stopped\n")
    assert _end(_failed, capsys) == (3, "error: rank 1 exited with code 3\n")


def _killed() -> None:
    raise launch.RankFailure("rank 1 was killed by SIGKILL", rank=1, exit_code=-signal.SIGKILL)


def _sigterm_twice_during_cleanup(done: list[str]) -> None:
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises here
    finally:
        os.kill(os.getpid(), signal.SIGTERM)  # a second SIGTERM while the cleanup runs
        time.sleep(0.2)
        done.append("cleanup")


def test_a_rank_killed_by_a_signal_gives_the_shells_status(capsys) -> None:
    """-N (killed by signal N) is 128 + N, as the runner's and a shell's status (before: 256 - N)."""
    assert _end(_killed, capsys) == (128 + signal.SIGKILL, "error: rank 1 was killed by SIGKILL\n")


def test_a_second_sigterm_does_not_cut_the_cleanup_short(capsys) -> None:
    done: list[str] = []
    before = signal.getsignal(signal.SIGTERM)
    assert _end(lambda: _sigterm_twice_during_cleanup(done), capsys)[0] == 143
    assert done == ["cleanup"] and signal.getsignal(signal.SIGTERM) is before


def test_a_commands_own_status_passes_through(capsys) -> None:
    assert _end(lambda: 2, capsys)[0] == 2
    assert _end(lambda: [{"row": 1}], capsys)[0] == 0  # the rows a main returns to in-process callers
    assert _end(lambda: None, capsys)[0] == 0

    def usage() -> None:
        raise SystemExit(2)

    assert _end(usage, capsys)[0] == 2


@pytest.mark.parametrize("alias", ALIASES)
def test_every_command_ends_through_run_command(alias: str) -> None:
    """Each alias's ``__main__`` runs its room's ``cli``, which is ``run_command`` around the work."""
    src = (Path(launch.__file__).parents[1] / f"{alias}.py").read_text()
    assert src.endswith('if __name__ == "__main__":\n    cli()\n'), f"experiments/{alias}.py"
    cli = importlib.import_module(f"zeropp.experiments.{alias}").cli
    assert "run_command(" in inspect.getsource(cli), f"{cli.__module__}.cli"


def test_ctrl_c_during_an_in_process_benchmark_is_one_line_and_130() -> None:
    """Before: a KeyboardInterrupt traceback from wherever the benchmark was."""
    argv = [sys.executable, "-m", "zeropp.experiments.bench_kernels", "--device", "cpu", "--no-compile"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as from a terminal
    )
    assert p.stdout is not None
    deadline = time.monotonic() + 120
    while "| copy" not in p.stdout.readline():  # the first row: the benchmark is timing
        assert time.monotonic() < deadline and p.poll() is None, "the benchmark ended before its first row"
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and err.strip().splitlines()[-1] == "error: interrupted by SIGINT; stopped", err
    assert "Traceback" not in err


def test_sigterm_during_a_swap_test_removes_its_scratch_files(tmp_path: Path) -> None:
    """Before: SIGTERM (``timeout``) ended the process on the spot and its swap folder, gigabytes
    under --dir, stayed behind."""
    argv = [sys.executable, "-m", "zeropp.experiments.bench_offload", "--sizes", "1k", "--repeat", "1"]
    argv += ["--swap-mib", "1024", "--dir", str(tmp_path)]
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not any(tmp_path.glob("zeropp-swap-*/*")):  # the swap file is being written
        assert time.monotonic() < deadline and p.poll() is None, "the swap test did not start"
        time.sleep(0.02)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 143 and err.strip().splitlines()[-1] == "error: interrupted by SIGTERM; stopped", err
    assert list(tmp_path.iterdir()) == []
