"""experiments/bench/gpu.py: argument handling and the table with a fake ``run_job``, and one real run
of the smallest configuration on CPU (two rows, world 1).

Here: the end-to-end checks. The topic's full description and its one-process checks are in
``tests/unit/test_bench_gpu.py``.
"""

from __future__ import annotations

from tests.bench_helpers import CPU_TINY
from zeropp.experiments.bench import gpu as bench_gpu


def test_real_cpu_run_of_the_smallest_configuration(capsys):
    rows = bench_gpu.main([*CPU_TINY, "--jobs", "stage0,zeropp"])
    assert set(rows) == {"stage0", "zeropp"} and all("error" not in r for r in rows.values())
    assert all(r["step_s"] > 0 and r["memory_bytes"] > 0 for r in rows.values())
    table = capsys.readouterr().out
    assert "zeropp stage 0" in table and "stage 3 + ZeRO++" in table
