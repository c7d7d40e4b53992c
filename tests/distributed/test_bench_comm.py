"""``bench_comm``'s rank side on a real 2-rank gloo world, tiny sizes: one row per collective,
format and size, with times, bandwidths and the busbw factor that make sense, and a kernel rate
per codec op of each format."""

from __future__ import annotations

from tests.worlds import run_world
from zeropp.experiments.bench.comm_rank import KERNEL_OPS, OPS, CommBenchSpec, busbw_factor, run_rank

SPEC = CommBenchSpec(nodes=2, ranks_per_node=1, formats=("int8", "mxfp4"), sizes=(1024, 4096), warmup=1, iters=2)


def _bench(rank: int, world: int) -> dict | None:
    return run_rank(SPEC, "gloo")


def test_the_benchmark_produces_sane_rows_on_two_ranks() -> None:
    result, other = run_world(_bench, 2)
    assert other is None and result["backend"] == "gloo"
    rows = result["rows"]
    # 2 ranks as 2 nodes x 1: only the world group (intra has one rank, inter is the world)
    assert {r["group"] for r in rows} == {"world"} and all(r["ranks"] == 2 for r in rows)
    keys = [(r["op"], r["format"], r["bytes"]) for r in rows]
    assert sorted(keys) == sorted((op, f, b) for op in OPS for f in ("plain", "int8", "mxfp4") for b in (1024, 4096))
    for r in rows:
        assert 0 < r["seconds"] < 5, r
        assert r["algbw_gbs"] == r["bytes"] / r["seconds"] / 1e9
        assert r["busbw_gbs"] == r["algbw_gbs"] * 1e9 * busbw_factor(r["op"], 2) / 1e9
    plain = {"all_gather": "ring", "all_reduce": "ring", "reduce_scatter": "ring all-reduce", "all_to_all": "pairwise"}
    assert all(r["algorithm"] == plain[r["op"]] for r in rows if r["format"] == "plain")
    quant = {r["algorithm"] for r in rows if r["format"] != "plain"}
    assert quant == {"encode+ring+decode", "qgZ a2a", "encode+pairwise+decode", "qgZ rs + q ag"}
    rates = {(q["op"], q["format"]): q["gbs"] for q in result["quant_rates"]}
    assert set(rates) == {(op, f) for op in KERNEL_OPS for f in ("int8", "mxfp4")} and min(rates.values()) > 0


def test_sigterm_to_the_benchmark_is_one_line_and_143(tmp_path) -> None:
    """SIGTERM while its world measures: the launcher reports it once (``error: interrupted by
    SIGTERM; all ranks stopped``), exit 143; the ranks, which run their entry bare, add no line of
    their own and none is left running."""
    import signal
    import subprocess
    import sys
    import time

    argv = [sys.executable, "-m", "zeropp.experiments.bench_comm", "--nodes", "1", "--ranks-per-node", "2"]
    argv += ["--ops", "all_reduce", "--formats", "none", "--max-bytes", "4M", "--iters", "100000"]
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not _measuring(_ranks_of(p.pid)):
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1][-2000:]
            time.sleep(0.2)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        "error: interrupted by SIGTERM; all ranks stopped"
    ], err[-2000:]


def _measuring(ranks: list[int], cpu_s: float = 4.0) -> bool:
    """Both ranks have run ``cpu_s`` s of CPU: past importing torch (about 2 s) and the rank's
    entry, into the measurement."""
    import os
    from pathlib import Path

    if len(ranks) < 2:
        return False
    tick = os.sysconf("SC_CLK_TCK")
    try:
        used = []
        for r in ranks:
            fields = Path(f"/proc/{r}/stat").read_text().rsplit(")", 1)[1].split()
            used.append((int(fields[11]) + int(fields[12])) / tick)  # utime + stime
    except (OSError, ValueError):
        return False
    return min(used) >= cpu_s


def _ranks_of(pid: int) -> list[int]:
    """The benchmark's rank processes: children of ``pid`` started with ``--rank-main``."""
    from pathlib import Path

    out = []
    for d in Path("/proc").iterdir():
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid and b"--rank-main" in cmd:
            out.append(int(d.name))
    return out
