"""ZeRO-3 vs ZeRO++ on an emulated cluster at several cross-node bandwidths (issue 6).

    sudo python -m experiments.bench_cluster                       # 2 nodes x 2 ranks, 0.1,0.5,2 Gbit/s
    python -m experiments.bench_cluster --gbps 0.2,1,5 --steps 6 --json out.json

For each bandwidth it builds one EmulatedCluster (namespaces, shaped links, throughput probe),
runs the same short training on it, ZeRO-3 and ZeRO++ (qwZ INT8 + hpZ + qgZ INT4) alternately
(--rounds each, fresh engine each time, one process per rank inside its node's namespace, one
process start for all runs), and prints the median step time (slowest rank
per step), the speedup, and the bytes each rank sent across nodes per step. Then it puts the
scaling projection (experiments/scaling.py) next to each measurement: the same workload (this
GPT's communication units, each run's own measured compute time = step - time blocked on
communication) on a Cluster with the *measured* link rate, and prints the relative error.

Why these defaults: the "medium" GPT (3.3M parameters, fp32 on the wire) with 2 sequences of 128
per rank keeps compute short enough on a 2-core CPU that ZeRO-3 is communication-bound at the
lowest rate, which is the regime ZeRO++ targets; as the rate grows both converge to compute time.
Needs root (network namespaces); without it, it says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from .cluster import ClusterPrivilegeError, EmulatedCluster, NetnsError
from .cluster.ranks import RankError, run_ranks
from .cluster.worker import mode_workload
from .scaling import project
from .scaling_check import emulator_cluster


def _per_step_max(reports: list[dict[str, Any]], mode: str) -> list[float]:
    """A synchronous step takes as long as its slowest rank."""
    return [max(vals) for vals in zip(*(r["runs"][mode]["step_s"] for r in reports))]


def _mean_or_none(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.mean(vals) if vals else None


def measure(cluster: EmulatedCluster, a: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Run ZeRO-3 and ZeRO++ alternately (`a.rounds` each) on the cluster's ranks; medians per mode."""
    reports = run_ranks(cluster, ["--mode", "zero3,zeropp", "--rounds", str(a.rounds), "--preset", a.preset,
                                  "--micro-batch", str(a.micro_batch), "--steps", str(a.steps),
                                  "--warmup", str(a.warmup), "--quant-rates"], timeout_s=a.timeout)
    out = {}
    for mode in ("zero3", "zeropp"):
        r0 = reports[0]["runs"][mode]
        step = statistics.median(_per_step_max(reports, mode))
        wait = statistics.median(r["runs"][mode]["comm_wait_s_median"] for r in reports)
        out[mode] = {"mode": mode, "step_s": step, "comm_wait_s": wait, "compute_s": max(step - wait, 0.0),
                     "step_s_all": _per_step_max(reports, mode),
                     "cross_bytes": statistics.mean(r["runs"][mode]["bytes_per_step"]["cross"] for r in reports),
                     "intra_bytes": statistics.mean(r["runs"][mode]["bytes_per_step"]["intra"] for r in reports),
                     # node uplink counters, read by each node's local rank 0 (rank % rpn == 0)
                     "uplink_bytes": _mean_or_none([r["runs"][mode]["uplink_tx_bytes_per_step"]
                                                    for i, r in enumerate(reports) if i % a.ranks_per_node == 0]),
                     "quant_rates": _median_rates([r["runs"][mode].get("quant_rates") or [] for r in reports]),
                     "loss_first": r0["losses"][0], "loss_last": r0["losses"][-1], "model": r0["model"],
                     "params": r0["params"], "tokens_per_rank": a.micro_batch * r0["seq_len"]}
    return out


def _median_rates(per_rank: list[list]) -> list[tuple[str, int, float]]:
    """Median over ranks of each (op, bits) throughput measured by the workers."""
    by: dict[tuple[str, int], list[float]] = {}
    for rates in per_rank:
        for op, bits, gbs in rates:
            by.setdefault((op, int(bits)), []).append(float(gbs))
    return [(op, bits, statistics.median(v)) for (op, bits), v in sorted(by.items())]


def predict(m: dict[str, Any], cluster: EmulatedCluster, gbps: float) -> dict[str, float]:
    """The scaling model's step time and bytes for measured run `m` (compute = its measured step
    minus its measured comm wait; quantization charged at the ranks' measured rates; one uplink
    per node shared by the node's ranks; link constants of ``scaling_check.EMULATOR_LINKS``)."""
    w = mode_workload(m["model"], m["mode"], compute_s=m["compute_s"], tokens_per_rank=m["tokens_per_rank"],
                      quant_rates=tuple(tuple(x) for x in m.get("quant_rates") or ()))
    p = project(w, emulator_cluster(cluster.spec.nodes, cluster.spec.ranks_per_node, gbps))
    cross = sum(v for k, v in p.pairwise.items() if k.endswith(".cross"))
    return {"step_s": p.step_s, "comm_s": p.comm_s, "quant_s": p.quant_s, "cross_bytes": cross,
            "uplink_bytes": p.uplink_bytes, "node_cross_bytes": p.node_cross_bytes}


def run(a: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for gbps in a.gbps:
        t0 = time.monotonic()
        with EmulatedCluster(a.nodes, a.ranks_per_node, gbps, a.latency_ms, probe_seconds=a.probe_seconds) as c:
            row: dict[str, Any] = {"gbps": gbps, "measured_gbps": c.measured_gbps, "rtt_ms": c.measured_rtt_ms}
            for mode, m in measure(c, a).items():
                m["predicted"] = predict(m, c, c.measured_gbps or gbps)
                row[mode] = m
        row["speedup"] = row["zero3"]["step_s"] / row["zeropp"]["step_s"]
        row["wall_s"] = time.monotonic() - t0
        rows.append(row)
        print(f"[{gbps:g} Gbit/s done in {row['wall_s']:.0f}s]", file=sys.stderr, flush=True)
    return rows


def _pct(pred: float, meas: float) -> str:
    return f"{100 * (pred / meas - 1):+.0f}%" if meas else "n/a"


def format_rows(rows: list[dict[str, Any]], a: argparse.Namespace) -> str:
    m0 = rows[0]["zero3"]
    out = [f"{a.nodes} nodes x {a.ranks_per_node} ranks, GPT '{a.preset}' ({m0['params'] / 1e6:.2f}M params, fp32), "
           f"{a.micro_batch}x{m0['model']['seq_len']} tokens/rank/step; median over {a.rounds} alternating runs x "
           f"{a.steps} steps (after {a.warmup} warm-up) of the slowest rank's step time",
           "",
           "| link Gbit/s (measured) | ZeRO-3 step s | ZeRO++ step s | speedup | x-node MB/rank/step (3 -> ++) |",
           "|---|---|---|---|---|"]
    for r in rows:
        z3, zp = r["zero3"], r["zeropp"]
        out.append(f"| {r['gbps']:g} ({r['measured_gbps']:.3f}) | {z3['step_s']:.3f} | {zp['step_s']:.3f} | "
                   f"{r['speedup']:.2f}x | {z3['cross_bytes'] / 1e6:.2f} -> {zp['cross_bytes'] / 1e6:.2f} |")
    out += ["", "Scaling projection vs measurement (compute = measured step - measured comm wait; link = measured rate, "
            "one uplink per node shared by its ranks; quantization at the ranks' measured kernel rates):", "",
            "| link Gbit/s | run | measured s | projection s | error | of which quant s | measured x-node MB/rank | predicted | error |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for mode, name in (("zero3", "ZeRO-3"), ("zeropp", "ZeRO++")):
            m, p = r[mode], r[mode]["predicted"]
            out.append(f"| {r['gbps']:g} | {name} | {m['step_s']:.3f} | {p['step_s']:.3f} | {_pct(p['step_s'], m['step_s'])} | "
                       f"{p['quant_s']:.3f} | {m['cross_bytes'] / 1e6:.2f} | {p['cross_bytes'] / 1e6:.2f} | "
                       f"{_pct(p['cross_bytes'], m['cross_bytes'])} |")
    out += ["", "Bytes one node's uplink sent per step (kernel tx counter, headers included) vs the projection's "
            "uplink_bytes (ranks sharing the uplink x pairwise cross bytes per rank):", "",
            "| link Gbit/s | run | measured uplink MB | predicted MB | error |", "|---|---|---|---|---|"]
    for r in rows:
        for mode, name in (("zero3", "ZeRO-3"), ("zeropp", "ZeRO++")):
            m, p = r[mode], r[mode]["predicted"]
            if m.get("uplink_bytes") is None:
                continue
            out.append(f"| {r['gbps']:g} | {name} | {m['uplink_bytes'] / 1e6:.2f} | {p['uplink_bytes'] / 1e6:.2f} | "
                       f"{_pct(p['uplink_bytes'], m['uplink_bytes'])} |")
    rates = rows[0]["zeropp"].get("quant_rates") or []
    if rates:
        out.append("\nZeRO++ quantization ops measured on the ranks (GB/s of fp32 input, median over ranks, "
                   f"{rows[0]['gbps']:g} Gbit/s run): " + ", ".join(f"{op} int{b} {g:.3f}" for op, b, g in rates))
    sp = [(r["zero3"]["predicted"]["step_s"] / r["zeropp"]["predicted"]["step_s"], r["speedup"]) for r in rows]
    out.append("\npredicted vs measured speedup: " + ", ".join(
        f"{r['gbps']:g} Gbit/s {p:.2f}x vs {m:.2f}x" for r, (p, m) in zip(rows, sp)))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.bench_cluster", description=__doc__.split("\n\n")[0])
    p.add_argument("--gbps", type=lambda s: [float(x) for x in s.split(",")], default=[0.1, 0.5, 2.0],
                   help="comma-separated cross-node rates, Gbit/s (default 0.1,0.5,2)")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--latency-ms", type=float, default=0.0, help="one-way cross-node latency (needs netem)")
    p.add_argument("--preset", default="medium", help="zeropp.models GPT preset")
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2, help="alternating ZeRO-3/ZeRO++ runs of each (noise control)")
    p.add_argument("--probe-seconds", type=float, default=1.0)
    p.add_argument("--timeout", type=float, default=600.0, help="per training run, seconds")
    p.add_argument("--json", default=None, help="also write all numbers to this file")
    a = p.parse_args(argv)
    try:
        rows = run(a)
    except (ClusterPrivilegeError, NetnsError) as e:
        print(f"error: {e}\n(this benchmark exists to cross a shaped link, so it needs the emulator; an unshaped "
              "comparison: python -m experiments.run cluster=local stage=3 quant=none, then quant=zeropp)", file=sys.stderr)
        return 2
    except RankError as e:
        print(f"error: a benchmark rank failed: {e}", file=sys.stderr)
        return 1
    print(format_rows(rows, a))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
