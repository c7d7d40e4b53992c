"""Run a function on a gloo world of N local processes and collect each rank's result.

Used by every multi-process test: ``results = run_world(fn, 4, arg1, ...)`` calls
``fn(rank, world_size, arg1, ...)`` in each of 4 processes after the default gloo process group
is initialised (destroyed after ``fn``), and returns the per-rank return values. It is a thin
wrapper over the toolkit's one launcher (``zeropp.experiments.launch.launch_world``): a rank that
raises or dies fails the call with an AssertionError naming that rank with its traceback, and a
world that does not finish within ``timeout`` seconds is killed and reported, so a broken
collective fails the test instead of hanging the suite. ``fn`` must be a module-level function
(it is pickled by name).
"""

from __future__ import annotations

import multiprocessing
from typing import Any, Callable

from zeropp.experiments.launch import RankFailure, RunInterrupted, launch_world

# Ranks are forked from multiprocessing's fork server, which imports these once: a spawned rank
# would spend seconds importing torch and zeropp, and the suite starts a few hundred worlds.
multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "zeropp.comm", "zeropp.runtime"])


def run_world(
    fn: Callable, world_size: int, *args: Any, timeout: float = 120.0, env: dict[str, str] | None = None
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.
    ``env``: extra environment of every rank (set by the launcher before ``fn`` runs)."""
    try:
        return launch_world(
            fn,
            world_size,
            args=args,
            process_group="gloo",
            threads=1,
            timeout_s=timeout,
            grace_s=2.0,
            extra_env=env,
            start_method="forkserver",
        )
    except RunInterrupted as e:  # Ctrl-C or a SIGTERM (``timeout``) to pytest: the ranks are stopped; pytest stops too
        raise KeyboardInterrupt(str(e)) from None
    except RankFailure as e:
        raise AssertionError(f"world of {world_size}: {e}") from None
