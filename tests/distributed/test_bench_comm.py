"""``bench_comm``'s rank side on a real 2-rank gloo world, tiny sizes: one row per collective,
format and size, with times, bandwidths and the busbw factor that make sense, and a kernel rate
per codec op of each format."""

from __future__ import annotations

from tests.worlds import run_world
from zeropp.experiments.bench.comm_rank import KERNEL_OPS, OPS, CommBenchSpec, busbw_factor, run_rank

SPEC = CommBenchSpec(nodes=2, ranks_per_node=1, formats=("int8", "mx4"), sizes=(1024, 4096), warmup=1, iters=2)


def _bench(rank: int, world: int) -> dict | None:
    return run_rank(SPEC, "gloo")


def test_the_benchmark_produces_sane_rows_on_two_ranks() -> None:
    result, other = run_world(_bench, 2)
    assert other is None and result["backend"] == "gloo"
    rows = result["rows"]
    # 2 ranks as 2 nodes x 1: only the world group (intra has one rank, inter is the world)
    assert {r["group"] for r in rows} == {"world"} and all(r["ranks"] == 2 for r in rows)
    keys = [(r["op"], r["format"], r["bytes"]) for r in rows]
    assert sorted(keys) == sorted((op, f, b) for op in OPS for f in ("plain", "int8", "mx4") for b in (1024, 4096))
    for r in rows:
        assert 0 < r["seconds"] < 5, r
        assert r["algbw_gbs"] == r["bytes"] / r["seconds"] / 1e9
        assert r["busbw_gbs"] == r["algbw_gbs"] * 1e9 * busbw_factor(r["op"], 2) / 1e9
    plain = {"all_gather": "ring", "all_reduce": "ring", "reduce_scatter": "ring all-reduce", "all_to_all": "pairwise"}
    assert all(r["algorithm"] == plain[r["op"]] for r in rows if r["format"] == "plain")
    quant = {r["algorithm"] for r in rows if r["format"] != "plain"}
    assert quant == {"encode+ring+decode", "qgZ a2a", "encode+pairwise+decode", "qgZ rs + q ag"}
    rates = {(q["op"], q["format"]): q["gbs"] for q in result["quant_rates"]}
    assert set(rates) == {(op, f) for op in KERNEL_OPS for f in ("int8", "mx4")} and min(rates.values()) > 0
