"""Ctrl-C while one of our commands is still importing (torch, triton, Hydra: a second or more).

Every ``python -m experiments.X`` / ``python -m zeropp.X`` command turns an interrupt into one
``error:`` line and exit status 130 once its ``main`` runs (``experiments.launch.command``), but
the imports before it are outside any handler, so a Ctrl-C in the first second printed Python's
traceback through ``importlib`` and torch's modules, and one that landed in the numpy import
torch's C code makes was swallowed there and the command ran on as if not interrupted.
:func:`quiet_interrupts_while_importing`, called by the packages' ``__init__`` when the process
was started as ``python -m`` one of our modules, installs a SIGINT handler that, while the
command's start-up imports run (the imports of its ``__main__`` module's body, or of runpy before
it), prints that one line and ends the process by SIGINT itself, as Python does for an uncaught
``KeyboardInterrupt`` (the shell sees 130): an exception could be swallowed by a C-level import,
and nothing of the command exists yet to clean up. Anywhere else (a lazy import inside ``main``,
ordinary code) it raises ``KeyboardInterrupt`` as Python's own handler does, so the commands'
own handling is unchanged. A user's script that imports zeropp keeps Python's handler.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from types import FrameType

__all__ = ["quiet_interrupts_while_importing", "run_as_module"]


def run_as_module(argv: list[str]) -> str | None:
    """The module name of ``python [options] -m MODULE ...`` in ``argv`` (``sys.orig_argv``: the
    interpreter's own command line), or None when it ran a script, ``-c`` or a REPL."""
    i = 1
    while i < len(argv):
        a = argv[i]
        if a == "-m":
            return argv[i + 1] if i + 1 < len(argv) else None
        if a.startswith("-m"):
            return a[2:]
        if a in ("-c", "-") or not a.startswith("-"):
            return None  # a command, stdin or a script: what follows belongs to it
        i += 2 if a in ("-W", "-X", "--check-hash-based-pycs") else 1  # these take the next token
    return None


def _starting(frame: FrameType | None) -> bool:
    """Whether the interrupted code runs in a start-up import: the outermost import on the stack
    was made by the ``__main__`` module's body (or by runpy locating it), not from a function."""
    caller = None
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            caller = frame.f_back  # the code that made this import; the last one seen is the outermost
        frame = frame.f_back
    if caller is None:
        return False
    where = caller.f_code.co_filename
    if where == "<frozen runpy>" or os.path.basename(where) == "runpy.py":  # (runpy is frozen from 3.11)
        return True
    return caller.f_code.co_name == "<module>" and caller.f_globals.get("__name__") == "__main__"


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    if _starting(frame):
        with contextlib.suppress(OSError):  # a closed stderr must not stop the stop
            print("error: interrupted by SIGINT while starting; stopped", file=sys.stderr, flush=True)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)  # ends the process here; an exception could be swallowed
        # still here: the process is a namespace's init (PID 1 in a container), which the kernel does
        # not end with a default-handled signal. Python's handler back, so a later Ctrl-C still counts.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        raise SystemExit(128 + signal.SIGINT)
    raise KeyboardInterrupt


def quiet_interrupts_while_importing(package: str) -> None:
    """Install the handler (module doc) when this process is ``python -m package.X`` (``package``:
    the calling package's own name, ``zeropp`` or ``experiments``), SIGINT still has Python's
    default handler, and this is the main thread (only it may set handlers); otherwise nothing. A
    user's ``python -m their_pkg.train`` that imports zeropp keeps Python's handler."""
    module = run_as_module(list(getattr(sys, "orig_argv", [])))
    if module is None or not (module == package or module.startswith(package + ".")):
        return
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)
