"""Run a function on a gloo world of N local processes and collect each rank's result.

Used by every multi-process test: ``results = run_world(fn, 4, arg1, ...)`` calls
``fn(rank, world_size, arg1, ...)`` in each of 4 spawned processes after the default process
group is initialised, and returns the per-rank return values. A rank that raises makes the whole
call fail with that rank's traceback; a world that does not finish within ``timeout`` seconds is
killed and reported, so a broken collective fails the test instead of hanging the suite.
``fn`` must be a module-level function (it is pickled by name).
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results: Any, pg_timeout: float) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=pg_timeout)
        )
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, out))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, False, traceback.format_exc()))


def run_world(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, fn, args, results, max(timeout - 5, 10)), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(out))
                raise AssertionError(f"world of {world_size} timed out after {timeout}s; ranks {missing} did not finish" + (
                    "\n" + "\n".join(errors) if errors else ""))
            try:
                rank, ok, val = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in out]
                if dead and not errors:
                    # a rank died without reporting (killed, segfault): give peers a moment, then fail
                    time.sleep(0.5)
                    if results.empty():
                        raise AssertionError(f"rank(s) {dead} died with exit codes {[procs[i].exitcode for i in dead]}")
                continue
            if ok:
                out[rank] = val
            else:
                errors.append(f"--- rank {rank} ---\n{val}")
                # One failure is enough: the others may be stuck waiting for it. Peers that fail
                # *because* of it ("connection closed by peer") can report first, so collect what
                # else arrives within a short grace period to include the original error too.
                grace = time.monotonic() + 3.0
                while len(out) + len(errors) < world_size and time.monotonic() < grace:
                    try:
                        rank, ok, val = results.get(timeout=max(grace - time.monotonic(), 0.01))
                    except queue.Empty:
                        break
                    if ok:
                        out[rank] = val
                    else:
                        errors.append(f"--- rank {rank} ---\n{val}")
                break
        if errors:
            raise AssertionError("a rank failed:\n" + "\n".join(errors))
        return [out[r] for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=2 if not errors else 0.1)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
