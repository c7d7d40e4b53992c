"""A process that used the collectives ends cleanly (``zeropp/comm/context.py``).

Here: the end-to-end checks. The topic's full description and its one-process checks are in
``tests/unit/test_comm_lifetime.py``; its gloo-world checks are in
``tests/distributed/test_comm_lifetime.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "data" / "readme_collectives.py"


# ------------------------------------------------------------------ the user's script under torchrun
def _torchrun(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_readme_script_under_torchrun_exits_cleanly_every_time() -> None:
    # without and with destroy_process_group(), one run each (ZEROPP_TORCHRUN_RUNS=N: N runs, to
    # hunt the intermittent symptom): the fault's cause (a gloo thread freeing a buffer's Python
    # object) is checked deterministically on a gloo world
    # (test_backend_threads_never_free_python_objects_of_zeropp_calls); this is the symptom
    runs = int(os.environ.get("ZEROPP_TORCHRUN_RUNS", "2"))
    failed = []
    for i in range(runs):
        p = _torchrun(*(["--destroy"] if i % 2 else []))
        ok = p.stdout.count(" ok: ") == 4
        if p.returncode != 0 or not ok or "terminate called" in p.stderr:
            failed.append(f"run {i}: exit {p.returncode}\n{p.stdout[-1500:]}\n{p.stderr[-3000:]}")
    assert not failed, f"{len(failed)} of {runs} runs failed:\n" + "\n".join(failed)
