"""experiments/cluster/ring_probe.py without root: its rank program on a local gloo world (the emulated
cluster only adds namespaces around the same processes) and its refusal of a one-node cluster.

Here: the end-to-end checks of this topic; its other tiers' checks are in ``tests/unit/test_ring_probe.py``.
"""

from __future__ import annotations

import json
import os
import subprocess

from zeropp.experiments.cluster import ring_probe


def test_rank_program_times_every_all_gather_on_a_local_world() -> None:
    port = ring_probe._free_port()
    procs = [
        subprocess.Popen(
            [*ring_probe._SELF, "--rank-main", "--nbytes", "4096", "--repeats", "3"],
            env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(r), "WORLD_SIZE": "2"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    seconds = json.loads(outs[0][0].strip().splitlines()[-1])["seconds"]
    assert len(seconds) == 3 and all(s > 0 for s in seconds)
    assert outs[1][0].strip() == ""  # only rank 0 reports
