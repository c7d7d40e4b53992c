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
benchmark's scratch files (a swap test's gigabytes) behind, unwinds like Ctrl-C
(``zeropp.interrupts.sigterm_raises``, which the doctor below this package uses too).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from typing import NoReturn

from zeropp.interrupts import Terminated, sigterm_raises
from zeropp.output_files import OutputWriteError

from .failure import RankFailure, RunInterrupted, shell_status

__all__ = ["Terminated", "run_command", "sigterm_raises"]


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
