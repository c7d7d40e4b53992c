"""``python -m experiments.bench_offload``'s DeepSpeed row with DeepSpeed installed: its
``DeepSpeedCPUAdam`` is built (a JIT build at first use, minutes) and timed beside ours, and
its update is AdamW's. Skipped where ``deepspeed`` is not installed (``pip install 'zeropp[peers]'``).

The topic's one-process checks (DeepSpeed absent, the table, the command) are in
``tests/unit/test_bench_offload.py``.
"""

from __future__ import annotations

import importlib.util

import pytest

from zeropp.experiments.bench import offload as bench

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed: pip install 'zeropp[peers]'"
)


def test_deepspeed_cpu_adam_is_timed_beside_ours() -> None:
    run = bench.runners()
    if not callable(run["deepspeed"]):
        pytest.fail(f"deepspeed is installed but its CPU Adam did not run: {run['deepspeed']}")
    rows = {r["kernel"]: r for r in bench.bench_adam(4097, 2, run)}
    ds = rows["deepspeed"]
    # its own arithmetic (fma-contracted, its own order): AdamW's update to a few ulps, not bit-exact
    assert ds["max_abs_diff"] <= 1e-6 and ds["seconds"] > 0 and ds["vs_deepspeed"] == 1.0
    assert all(r["vs_deepspeed"] > 0 for r in rows.values())
