"""The benchmarks' shared argument checks (experiments/bench/args.py): every bench refuses a count
below its floor with argparse's usage error (exit 2) naming the flag as typed."""

from __future__ import annotations

import pytest

from zeropp.experiments.bench import cluster as bench_cluster
from zeropp.experiments.bench import fsdp as bench_fsdp
from zeropp.experiments.bench import gpu as bench_gpu

CASES = [
    (bench_gpu, ["--steps", "0"], "--steps must be >= 1, got 0"),
    (bench_gpu, ["--warmup", "-1"], "--warmup must be >= 0, got -1"),
    (bench_gpu, ["--n-layers", "-3"], "--n-layers must be >= 0, got -3"),
    (bench_fsdp, ["--seq", "0"], "--seq must be >= 1, got 0"),
    (bench_fsdp, ["--warmup", "-2"], "--warmup must be >= 0, got -2"),
    (bench_cluster, ["--ranks-per-node", "0"], "--ranks-per-node must be >= 1, got 0"),
    (bench_cluster, ["--warmup", "-1"], "--warmup must be >= 0, got -1"),
    (bench_cluster, ["--gbps", "1,0"], "--gbps=0 is not a rate the emulator can shape: give Gbit/s from 0.001 to 400"),
    (bench_cluster, ["--coalesce", "-1"], "--coalesce must be >= 0 elements, got -1"),
]


@pytest.mark.parametrize(
    "bench,argv,msg", CASES, ids=[f"{b.__name__.rsplit('.', 1)[-1]}:{' '.join(a)}" for b, a, _ in CASES]
)
def test_each_bench_refuses_a_count_below_its_floor(bench, argv, msg, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


@pytest.mark.parametrize("bench", [bench_gpu, bench_fsdp, bench_cluster])
def test_defaults_pass_the_checks(bench) -> None:
    a = bench.parse_args([])
    assert a.warmup >= 0 and a.steps >= 1
