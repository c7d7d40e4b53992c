"""Run the emulated-cluster benchmark's worker on every rank of an EmulatedCluster (thin wrapper).

The ranks start through the one launcher (``experiments/launcher.py``) with the cluster's
placement; each rank writes ``<out>/rank<r>.json`` and this returns those reports by rank.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from ..launcher import ModuleEntry, RankFailure, cluster_placement, launch_world
from .emulator import EmulatedCluster

WORKER = "zeropp.experiments.cluster.worker"

RankError = RankFailure
"""A rank exited non-zero or the world did not finish in time (the launcher's error)."""


def run_ranks(cluster: EmulatedCluster, worker_args: list[str], *, timeout_s: float = 300.0,
              out_dir: Path | None = None, module: str = WORKER) -> list[dict[str, Any]]:
    """``python -m module worker_args --out DIR --ranks-per-node N`` on every rank of the (up) cluster.

    Returns each rank's ``rank<r>.json``; ``out_dir`` defaults to a temporary directory. Ranks
    other than 0 write ``DIR/rank<r>.log``; a failure raises :data:`RankError` naming the rank.
    """
    if out_dir is None:
        with tempfile.TemporaryDirectory(prefix="zpp-ranks-") as tmp:
            return run_ranks(cluster, worker_args, timeout_s=timeout_s, out_dir=Path(tmp), module=module)
    out_dir.mkdir(parents=True, exist_ok=True)
    entry = ModuleEntry(module=module, args=(*worker_args, "--out", str(out_dir),
                                             "--ranks-per-node", str(cluster.spec.ranks_per_node)))
    launch_world(entry, cluster.world_size, placement=cluster_placement(cluster), log_dir=out_dir,
                 timeout_s=timeout_s, grace_s=2.0, ranks_per_node=cluster.spec.ranks_per_node)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(cluster.world_size)]
