"""How every ``python -m experiments.X`` command ends when it is interrupted or its ranks fail.

A command runs its work either in this process (the kernel and offload benchmarks, the wire-format
study) or in a world of ranks (:func:`experiments.launch.launch_world`). Ctrl-C then reaches it
as Python's ``KeyboardInterrupt`` in the first case and as :class:`RunInterrupted` (every rank
already stopped) in the second; a rank that fails arrives as :class:`RankFailure`. None of these
is a bug of the command, so none should end in a Python traceback: :func:`run_command` turns
each into one ``error:`` line and the exit status a shell expects (128 + the signal for an
interrupt, so 130 for Ctrl-C; the failing rank's status, else 1, for a failed world).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from typing import NoReturn

from .failure import RankFailure, RunInterrupted

__all__ = ["run_command"]


def run_command(main: Callable[[], object]) -> NoReturn:
    """Run a command's ``main`` and exit: with its return value when that is an int (0 for
    anything else, e.g. the rows a benchmark returns to its in-process callers), or as the module
    doc says when it is interrupted or its ranks fail. ``SystemExit`` (argparse's usage errors,
    a command's own status) passes through unchanged."""
    try:
        status = main()
    except RunInterrupted as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code or 128 + signal.SIGINT)
    except KeyboardInterrupt:
        print("error: interrupted by SIGINT; stopped", file=sys.stderr)
        sys.exit(128 + signal.SIGINT)
    except RankFailure as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code or 1)
    sys.exit(status if isinstance(status, int) and not isinstance(status, bool) else 0)
