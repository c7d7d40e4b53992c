"""A module rank for ``tests/distributed/test_comm_lifetime.py``: a rank that leaves alone while a
comm-worker continuation waits on its in-flight collective, then exits the normal way (atexit
hooks and interpreter finalization run, as in the runner's ranks).

``python -m tests.abort_rank <rank> <store file> <note file>`` in a world of two: rank 0 issues an
all-reduce rank 1 never joins, queues a continuation that waits on it, fails, aborts its groups
and exits 1; rank 1 waits in a collective on another group, which rank 0 never issues, writes how
that wait ended (seconds and error) to the note file, and exits 0.
"""

from __future__ import annotations

import datetime
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from zeropp.comm import chain, context
from zeropp.comm.backend import backend_all_reduce

CPU = torch.device("cpu")


def main(rank: int, store: str, note: Path) -> int:
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120)
    )
    sub = dist.new_group([0, 1])
    if rank == 0:
        handle = backend_all_reduce(torch.ones(8), dist.ReduceOp.SUM, None, True)  # never joined
        chain.submit(lambda: handle.wait(), CPU)  # the comm worker now waits on it
        time.sleep(0.5)
        context.abort_process_groups()  # a rank leaving alone, as the runner's worker does
        return 1
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(3), group=sub)
        note.write_text("returned")
    except RuntimeError as e:
        note.write_text(f"{time.monotonic() - t0:.1f} {e}")
    context.abort_process_groups()  # its peer is gone: it leaves alone too
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])))
