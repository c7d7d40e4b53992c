"""How every ``python -m experiments.X`` command ends when it is interrupted or its ranks fail.

A command runs its work either in this process (the kernel and offload benchmarks, the wire-format
study) or in a world of ranks (:func:`experiments.launch.launch_world`). Ctrl-C then reaches it
as Python's ``KeyboardInterrupt`` in the first case and as :class:`RunInterrupted` (every rank
already stopped) in the second; a rank that fails arrives as :class:`RankFailure`. None of these
is a bug of the command, so none should end in a Python traceback: :func:`run_command` turns
each into one ``error:`` line and the exit status a shell expects (128 + the signal for an
interrupt, so 130 for Ctrl-C and 143 for SIGTERM; the failing rank's status, else 1, for a
failed world). An output file the system refuses at the end (a full disk:
``zeropp.output_files.OutputWriteError``) is one line too, exit 1. SIGTERM, which would otherwise end the process on the spot and leave a
benchmark's scratch files (a swap test's gigabytes) behind, unwinds like Ctrl-C.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Callable, Iterator
from typing import NoReturn

from zeropp.interrupts import end_start_up
from zeropp.output_files import OutputWriteError

from .failure import RankFailure, RunInterrupted, shell_status

__all__ = ["Terminated", "run_command", "sigterm_raises"]


class Terminated(BaseException):
    """SIGTERM arrived (``timeout``, a scheduler's preemption, ``kill``): raised in the main thread
    like Python's ``KeyboardInterrupt`` for SIGINT, so that ``finally`` blocks and context managers
    run (a benchmark's scratch files are removed) instead of the process ending on the spot."""


def _raise_terminated(signum: int, frame: object) -> None:
    """Raise :class:`Terminated` once: a repeated SIGTERM (``kill`` typed twice, a supervisor's
    second try) is ignored, so the cleanup the first one started (a swap folder removed) runs to
    its end; ``run_command`` restores the previous handler afterwards."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """While inside: SIGTERM raises :class:`Terminated` in the main thread (once; the previous
    handler is restored afterwards). ``run_command`` runs a command's ``main`` so, and the runner
    its Hydra app (``runner/run.py``: a SIGTERM before the ranks start, or between a sweep's
    points, is one line too). Start-up ends here (``zeropp.interrupts.end_start_up``): the handler
    restored afterwards is the default disposition, not the start-up stand-in, so a SIGTERM while
    the main thread then waits in C (the interpreter's shutdown) still ends the process at once."""
    end_start_up()
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_command(main: Callable[[], object]) -> NoReturn:
    """Run a command's ``main`` and exit: with its return value when that is an int (0 for
    anything else, e.g. the rows a benchmark returns to its in-process callers), or as the module
    doc says when it is interrupted or its ranks fail. ``SystemExit`` (argparse's usage errors,
    a command's own status) passes through unchanged. SIGTERM is turned into :class:`Terminated`
    while ``main`` runs (a world of ranks installs its own handler meanwhile and reports it as
    :class:`RunInterrupted`)."""
    try:
        with sigterm_raises():
            status = main()
    except RunInterrupted as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code or 128 + signal.SIGINT)
    except KeyboardInterrupt:
        print("error: interrupted by SIGINT; stopped", file=sys.stderr)
        sys.exit(128 + signal.SIGINT)
    except Terminated:
        print("error: interrupted by SIGTERM; stopped", file=sys.stderr)
        sys.exit(128 + signal.SIGTERM)
    except RankFailure as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(shell_status(e.exit_code))
    except OutputWriteError as e:  # the disk filled while the command ran: what was printed stands
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    sys.exit(status if isinstance(status, int) and not isinstance(status, bool) else 0)
