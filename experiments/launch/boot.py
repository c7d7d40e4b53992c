"""What runs inside a rank before its entry: the module ranks' bootstrap and the function ranks'
entrypoint.

Both give the rank the same guarantees (why a bootstrap at all: ``world.py``'s docstring): its own
process group, ``PR_SET_PDEATHSIG`` = SIGKILL (a SIGKILLed launcher takes its ranks along) and
one log file for stdout and stderr. :data:`BOOT` is the few stdlib lines a module rank's
interpreter runs first; :func:`function_rank` is what torch's multiprocessing calls in a
function rank.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import signal
from typing import Any, Callable

import torch

from zeropp import watch

_PR_SET_PDEATHSIG = 1


BOOT = """import ctypes, os, signal, sys
ctypes.CDLL(None).prctl(1, signal.SIGKILL)
if os.getppid() != int(sys.argv[1]):
    os._exit(70)
if sys.argv[2]:
    fd = os.open(sys.argv[2], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1); os.dup2(fd, 2); os.close(fd)
os.execvp(sys.argv[3], sys.argv[3:])
"""
"""Run by ``python -I -S -c`` as every module rank's first image (see the module docstring)."""


def prctl_pdeathsig() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def redirect_output(path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def function_rank(
    fn: Callable,
    args: tuple,
    log: str,
    process_group: str | None,
    pg_timeout_s: float,
    threads: int | None,
    environ: dict[str, str] | None = None,
) -> Any:
    """Entrypoint of a function rank (runs in the child; torch's ``_wrap`` applies ``@record``).

    Gives the rank what the bootstrap gives a module rank (own process group for the final SIGKILL
    of grandchildren, PDEATHSIG=SIGKILL, its log file), then runs ``fn(rank, world_size, *args)``
    inside a default process group of ``process_group`` when one is asked for. ``environ``: the
    whole environment the rank must have (a forkserver child otherwise keeps the server's).
    """
    if environ is not None:
        elastic = {k: v for k, v in os.environ.items() if k.startswith("TORCHELASTIC_")}  # set by torch's _wrap
        os.environ.clear()
        os.environ.update(environ)
        os.environ.update(elastic)
    os.setsid()
    prctl_pdeathsig()
    if log:
        redirect_output(log)
    watch.start()  # liveness from the start; progress beats are up to fn (zeropp.experiments.launch.heartbeat)
    if threads:
        torch.set_num_threads(threads)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if process_group is None:
        return fn(rank, world, *args)
    import torch.distributed as dist

    dist.init_process_group(
        process_group, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=pg_timeout_s)
    )
    left_alone = True  # an error or a SIGTERM of this rank: its peers may wait in a collective with it
    try:
        out = fn(rank, world, *args)
        left_alone = False
        return out
    finally:
        from zeropp.comm.context import close_process_groups

        close_process_groups(aborted=left_alone)  # peers fail at once, not at the SIGKILL after grace_s
