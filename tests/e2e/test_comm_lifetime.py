"""A process that used the collectives ends cleanly (``zeropp/comm/context.py``).

The fault users met: a torchrun script of README's shape printed correct results, then one rank
died of SIGABRT ("terminate called without an active exception"): 9 of 20 runs of
``tests/data/readme_collectives.py`` on 4 ranks (8 of 20 with ``destroy_process_group()``), because a gloo worker thread freed the Python object of a collective's temporary buffer
while the interpreter was finalizing. The checks, cheapest first:

- the comm context on its own: close() drains and joins the worker (bounded, with a warning),
  the next continuation starts a new one, and buffers the backend still references are held;
- on a gloo world: no Python object handed to the backend through zeropp is ever freed by a gloo
  thread (a weakref finalizer records the freeing thread; raw ``torch.distributed`` calls are the
  reference that shows such frees happen), and destroy_process_group then a new
  init_process_group stops the worker and starts a fresh one that serves the new world;
- the user's script itself (``tests/data/readme_collectives.py``, 4 ranks as 2 nodes of 2) under
  torchrun, several times, every other run ending with ``destroy_process_group()``: every run
  exits 0. ``ZEROPP_TORCHRUN_RUNS`` sets how many (default 5; the acceptance bar is 20).

Here: the end-to-end checks of this topic; its other tiers' checks are in
``tests/unit/test_comm_lifetime.py``, ``tests/distributed/test_comm_lifetime.py``.
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
    runs = int(os.environ.get("ZEROPP_TORCHRUN_RUNS", "5"))
    failed = []
    for i in range(runs):
        p = _torchrun(*(["--destroy"] if i % 2 else []))
        ok = p.stdout.count(" ok: ") == 4
        if p.returncode != 0 or not ok or "terminate called" in p.stderr:
            failed.append(f"run {i}: exit {p.returncode}\n{p.stdout[-1500:]}\n{p.stderr[-3000:]}")
    assert not failed, f"{len(failed)} of {runs} runs failed:\n" + "\n".join(failed)
