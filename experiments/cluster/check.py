"""A connectivity check rank: rendezvous, a sum of ranks, a 4 MiB all-reduce, a JSON report.

``python -m zeropp.experiments.cluster.check --out DIR`` on every rank (started by the launcher,
in or out of an emulated cluster's namespaces) writes ``DIR/rank<r>.json``: the all-reduced sum
of ranks and what it should be, whether the large all-reduce came back right, the seconds it took,
the gloo interface and the torchrun env the rank saw. ``--fail-rank R`` makes rank R raise
before the collectives (the launcher's failure path is tested with it). ``main`` is wrapped in
torch's ``@record``, so a failure lands in the launcher's error file with its traceback.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from zeropp.interrupts import end_start_up


def check(rank: int, world: int) -> dict[str, object]:
    """Run the collectives on the initialised default group and say whether they were right."""
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    big = torch.ones(1 << 20)
    t0 = time.perf_counter()
    dist.all_reduce(big)
    return {
        "sum": float(t.item()),
        "expected": world * (world - 1) / 2,
        "big_ok": bool((big == world).all()),
        "big_s": time.perf_counter() - t0,
    }


@record
def main(argv: list[str] | None = None) -> None:
    end_start_up()  # the start-up SIGTERM stand-in off: a SIGTERM in a C wait ends the process at once
    p = argparse.ArgumentParser(prog="python -m zeropp.experiments.cluster.check")
    p.add_argument("--out", required=True, help="directory for rank<r>.json")
    p.add_argument("--fail-rank", type=int, default=-1, help="this rank raises before the collectives")
    p.add_argument("--pg-timeout", type=float, default=60.0, help="process-group timeout (s)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=a.pg_timeout))
    try:
        if rank == a.fail_rank:
            raise RuntimeError(f"check: failing on purpose on rank {rank} (--fail-rank)")
        out = check(rank, world)
        out.update(
            rank=rank,
            world=world,
            ifname=os.environ.get("GLOO_SOCKET_IFNAME"),
            env={k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")},
        )
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
