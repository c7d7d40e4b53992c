"""Start one process per rank inside an EmulatedCluster's namespaces and collect their reports.

Used by the benchmark and the tests (the Hydra runner has its own launcher, which wraps ranks the
same way: ``cluster.rank_command_prefix(rank)`` + ``cluster.rank_env(rank, port)``). A rank that
fails or a world that overruns its timeout stops every rank (by pid) and raises with the failing
rank's stderr, so a broken link or collective fails loudly instead of hanging.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .emulator import EmulatedCluster

WORKER = "zeropp.experiments.cluster.worker"


class RankError(RuntimeError):
    """A rank exited non-zero, or the world did not finish in time."""


def start_ranks(cluster: EmulatedCluster, worker_args: list[str], out_dir: Path,
                module: str = WORKER) -> list[subprocess.Popen]:
    """Popen every rank of `cluster` as ``python -m module worker_args --out out_dir`` in its namespace."""
    out_dir.mkdir(parents=True, exist_ok=True)
    port = random.randint(20000, 40000)  # the port lives in node 0's fresh namespace: nothing else binds there
    procs = []
    try:
        for rank in range(cluster.world_size):
            env = {**os.environ, **cluster.rank_env(rank, port)}
            cmd = [*cluster.rank_command_prefix(rank), sys.executable, "-m", module, *worker_args,
                   "--out", str(out_dir), "--ranks-per-node", str(cluster.spec.ranks_per_node)]
            with open(out_dir / f"rank{rank}.err", "wb") as err:
                procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                              stdin=subprocess.DEVNULL))
    except BaseException:
        stop_ranks(procs)
        raise
    return procs


def stop_ranks(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def wait_ranks(procs: list[subprocess.Popen], out_dir: Path, timeout_s: float) -> list[dict[str, Any]]:
    """Wait for all ranks; return their rank<r>.json reports, or stop all and raise RankError."""
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                r = bad[0]
                raise RankError(f"rank {r} exited with {codes[r]}:\n{_tail(out_dir / f'rank{r}.err')}")
            if all(c == 0 for c in codes):
                return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(len(procs))]
            if time.monotonic() > deadline:
                raise RankError(f"ranks did not finish within {timeout_s:.0f}s (still running: "
                                f"{[r for r, c in enumerate(codes) if c is None]})\n{_tail(out_dir / 'rank0.err')}")
            time.sleep(0.05)
    finally:
        stop_ranks(procs)


def run_ranks(cluster: EmulatedCluster, worker_args: list[str], *, timeout_s: float = 300.0,
              out_dir: Path | None = None) -> list[dict[str, Any]]:
    """start_ranks + wait_ranks; a temporary output directory unless `out_dir` is given."""
    if out_dir is None:
        with tempfile.TemporaryDirectory(prefix="zpp-ranks-") as tmp:
            return wait_ranks(start_ranks(cluster, worker_args, Path(tmp)), Path(tmp), timeout_s)
    return wait_ranks(start_ranks(cluster, worker_args, out_dir), out_dir, timeout_s)


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no stderr)"
