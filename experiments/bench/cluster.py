"""ZeRO-3 vs ZeRO++ on an emulated cluster at several cross-node bandwidths.

    sudo python -m experiments.bench_cluster                       # 2 nodes x 2 ranks, 0.1,0.5,2 Gbit/s
    python -m experiments.bench_cluster --gbps 0.2,1,5 --steps 6 --json out.json
    sudo python -m experiments.bench_cluster --check               # the scaling model's error, per cell

Every measurement is one runner job (``experiments.runner.run.run_job``, exactly ``python -m
experiments.run cluster=emulated cluster.inter_gbps=<g> stage=3 quant=none|zeropp ...``): the
same worker and trainer as any run, its own shaped namespaces and link probe. For each bandwidth
ZeRO-3 and ZeRO++ (qwZ INT8 + hpZ + qgZ INT4) run alternately (``--rounds`` each, so both see
the same drift of the host's load); the table shows the median over rounds of each run's median
step time (rank 0's, after the warm-up steps), the speedup, and the bytes each rank sent across
nodes per step (the engine's CommStats). A second table gives each mode's CPU seconds per step
(all ranks' processes, every thread; the runner's ``cpu_s_per_step``) and the busy fraction of the
host's cores, ``cpu / (step x cores)``: near 1 the step is bound by the CPU, and only less CPU work
makes it shorter; below 1 cores idle while ranks wait (read it on a quiet host: other processes'
load takes cores from the ranks). Then it puts the scaling projection
(experiments/projection/scaling.py) next to each measurement: the same workload (this GPT's communication
units, the run's own measured compute time = step - time blocked on communication) on a Cluster
with the *measured* link rate, and prints the relative error.

Why these defaults: the "medium" GPT (3.3M parameters, fp32 on the wire) with 2 sequences of 128
per rank keeps compute short enough on a 2-core CPU that ZeRO-3 is communication-bound at the
lowest rate, which is the regime ZeRO++ targets; as the rate grows both converge to compute time.
``--check`` runs a small grid (ZeRO-3 and ZeRO++ at 0.2 and 1 Gbit/s, three alternating runs each,
plus the same jobs unshaped on ``cluster=local``) and prints, per cell, the measured step time
against three predictions, all with compute = the run's measured step - its measured wait:

* **scheduled model** (the verdict): ``step_schedule.project_scheduled`` -- the engine's issue
  order replayed on a compute resource and a link resource, so prefetched gathers and in-flight
  reduce-scatters overlap compute as they do in the engine; the CPU side of communication
  (per-message latency, a copy of every sent byte, quantization at kernel rates timed right
  after the jobs in one process per rank at once) calibrated per mode on the unshaped run
  (``scaling_check.calibrate_cpu_side``), the link at the probed rate;
* **measured CPU + modelled link**: the unshaped runs' wait overlapped with the model's uplink
  time, ``max(wait_local, uplink / rate)``;
* **serial model**: ``scaling.project``, compute + communication, with the uncalibrated
  :data:`~experiments.projection.scaling_check.EMULATOR_LINKS` constants and the measured loopback rate;

with each error, and whether every cell of the scheduled model is within +-15% (exit 1 if not).

The predictions and the ``--check`` verdict are ``cluster_check.py``'s; here the runs, the table
and the command. Needs root (network namespaces); without it, it says so and exits 2. Run directories go to a
temporary directory, or under ``--out`` to keep them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NoReturn

from zeropp.output_files import path_text_arg, write_output_file

from ..cluster.emulator import link_problem
from ..cluster.netns import ClusterPrivilegeError, NetnsError, require_privileges
from ..launch.command import run_command
from ..projection.calibration import measure_loopback_gbps
from ..projection.cluster_file import ClusterFile, ClusterFileError, read_cluster_file
from ..projection.scaling_check import comm_wait_s, link_gbps
from ..runner.config import ConfigError
from ..runner.launcher import RankFailure
from ..runner.preflight import host_cpus
from ..runner.run import run_job
from .args import check_fresh_out, check_json_output, check_run_lengths, json_with_keys
from .cluster_check import (
    CHECK_GRID,
    CHECK_TOLERANCE,
    MODES,
    check_cells,
    compare_constants,
    format_check,
    predict,
    quant_rates_for,
)

NAMES = (("zero3", "ZeRO-3"), ("zeropp", "ZeRO++"))
"""The modes in table order, with their names."""

UPLINK_KEY = "uplink_tx_bytes_per_step"
"""Summary key of the bytes one node's uplink sent per measured step (its kernel tx counter,
headers included; every ``cluster=emulated`` run records it, ``runner.metrics``), compared with the
projection's ``uplink_bytes``."""


def job_overrides(a: argparse.Namespace, gbps: float, mode: str) -> list[str]:
    """The runner overrides of one measurement (identical for both modes but ``quant=``)."""
    return [
        "cluster=emulated",
        f"cluster.inter_gbps={gbps}",
        f"cluster.inter_latency_ms={a.latency_ms}",
        f"topology.nodes={a.nodes}",
        f"topology.ranks_per_node={a.ranks_per_node}",
        f"model={a.preset}",
        "stage=3",
        f"quant={MODES[mode]}",
        f"zero.coalesce_numel={a.coalesce}",
        f"zero.keep_at_turn={str(a.keep_at_turn).lower()}",
        f"train.steps={a.warmup + a.steps}",
        f"train.throughput_skip_steps={a.warmup}",
        f"train.micro_batch_size={a.micro_batch}",
        "data=random",
        "logger=none",
        "launcher.progress=false",
        "launcher.device=cpu",
        f"launcher.timeout_s={a.timeout}",
    ]


def local_overrides(a: argparse.Namespace, mode: str) -> list[str]:
    """The same job on ``cluster=local`` (no namespaces, no shaped link): ``--check``'s measure of
    what the step's communication costs the CPU (kernels, copies, per-message overheads, the
    ranks' contention) when no link limits it."""
    return ["cluster=local", *job_overrides(a, 1.0, mode)[3:]]


def aggregate(mode: str, summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the rounds of one mode's runs (their summary.json contents)."""
    steps = [s["step_time_s"]["median"] for s in summaries]
    step = statistics.median(steps)
    wait = statistics.median(comm_wait_s(s) or 0.0 for s in summaries)
    by_link = [(s["engine_comm_bytes_per_step"] or s["comm_bytes_per_step"])["by_link"] for s in summaries]
    rates = [g for s in summaries if (g := link_gbps(s)) is not None]
    uplink = [u for s in summaries if (u := s.get(UPLINK_KEY)) is not None]
    cpu = [c for s in summaries if (c := s.get("cpu_s_per_step")) is not None]
    return {
        "mode": mode,
        "step_s": step,
        "comm_wait_s": wait,
        "compute_s": max(step - wait, 0.0),
        "step_s_all": steps,
        "measured_gbps": statistics.median(rates) if rates else None,
        "cross_bytes": statistics.mean(b["cross"] for b in by_link),
        "intra_bytes": statistics.mean(b["intra"] for b in by_link),
        "uplink_bytes": statistics.median(uplink) if uplink else None,
        "cpu_s": statistics.median(cpu) if cpu else None,
        "loss_first": summaries[0]["loss"]["first"],
        "loss_last": summaries[0]["loss"]["final"],
        "params": summaries[0]["model"]["params"],
        "seq_len": summaries[0]["config"]["model"]["seq_len"],
        "run_dirs": [s.get("run_dir") for s in summaries],
    }


def run(a: argparse.Namespace, root: Path, cluster_file: ClusterFile | None = None) -> list[dict[str, Any]]:
    rows = []
    rates: dict[str, tuple] = {}  # per mode, timed once after that mode's first jobs
    local: dict[str, dict[str, float]] = {}
    if a.check:  # the link-free reference of each mode and the host's loopback rate, once
        loopback = measure_loopback_gbps(a.nodes * a.ranks_per_node)
        waits: dict[str, list[float]] = {mode: [] for mode in MODES}
        for r in range(a.rounds):  # alternating, like the shaped runs; the median wait of each
            for mode in MODES:
                ls = run_job(local_overrides(a, mode), root / "local" / f"{mode}-{r}")
                waits[mode].append(comm_wait_s(ls) or 0.0)
        local = {mode: {"comm_wait_s": statistics.median(v), "loopback_gbps": loopback} for mode, v in waits.items()}
        print(
            f"[check: loopback {loopback:.2f} Gbit/s per rank; unshaped comm wait "
            + ", ".join(f"{k} {v['comm_wait_s']:.3f} s" for k, v in local.items())
            + "]",
            file=sys.stderr,
            flush=True,
        )
    for gbps in a.gbps:
        t0 = time.monotonic()
        runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
        for r in range(a.rounds):
            for mode in MODES:
                runs[mode].append(run_job(job_overrides(a, gbps, mode), root / f"{gbps:g}gbps" / f"{mode}-{r}"))
        row: dict[str, Any] = {"gbps": gbps}
        for mode, sums in runs.items():
            m = aggregate(mode, sums)
            if mode not in rates:
                rates[mode] = quant_rates_for(sums[0])
            link = m["measured_gbps"] or gbps
            m["predicted"] = predict(m, sums[0], link, rates[mode], local.get(mode), cluster_file=cluster_file)
            if cluster_file is not None:  # the same runs under the hand-set constants, for the comparison
                m["predicted_handset"] = predict(m, sums[0], link, rates[mode], local.get(mode))
            row[mode] = m
        row["measured_gbps"] = row["zero3"]["measured_gbps"]
        row["speedup"] = row["zero3"]["step_s"] / row["zeropp"]["step_s"]
        row["wall_s"] = time.monotonic() - t0
        rows.append(row)
        print(f"[{gbps:g} Gbit/s done in {row['wall_s']:.0f}s]", file=sys.stderr, flush=True)
    return rows


def _pct(pred: float, meas: float) -> str:
    return f"{100 * (pred / meas - 1):+.0f}%" if meas else "n/a"


def cpu_table(rows: list[dict[str, Any]], cores: int) -> list[str]:
    """Lines of the CPU table: per run, the CPU seconds all ranks' processes used per step (median
    over rounds of the runs' ``cpu_s_per_step``) and how busy that kept the host's ``cores``
    (``cpu / (step x cores)``): near 1, the step is bound by the CPU and only less CPU work makes
    it shorter; well below 1, the cores idle while ranks wait (a link, a late rank). The load
    average says how much of the cores other processes took; none when no run recorded CPU time."""
    cells = [(r, mode, name) for r in rows for mode, name in NAMES if r[mode].get("cpu_s") is not None]
    if not cells:
        return []
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    out = [
        "",
        f"CPU time of all ranks' processes per step (every thread) and the busy fraction of the host's "
        f"{cores} cores, cpu / (step x {cores}); load average {load} at the end:",
        "",
        "| link Gbit/s | run | step s | CPU s/step | busy |",
        "|---|---|---|---|---|",
    ]
    for r, mode, name in cells:
        m = r[mode]
        busy = m["cpu_s"] / (m["step_s"] * cores) if m["step_s"] > 0 else math.nan
        out.append(f"| {r['gbps']:g} | {name} | {m['step_s']:.3f} | {m['cpu_s']:.3f} | {busy:.2f} |")
    return out


def format_rows(rows: list[dict[str, Any]], a: argparse.Namespace, cores: int | None = None) -> str:
    """The tables of a run; ``cores``: the cores the ranks share (default: this process's,
    ``preflight.host_cpus``)."""
    cores = host_cpus() if cores is None else cores
    m0 = rows[0]["zero3"]
    out = [
        f"{a.nodes} nodes x {a.ranks_per_node} ranks, GPT '{a.preset}' ({m0['params'] / 1e6:.2f}M params, fp32), "
        f"{a.micro_batch}x{m0['seq_len']} tokens/rank/step; median over {a.rounds} alternating runs of each run's "
        f"median step time ({a.steps} steps after {a.warmup} warm-up)",
        "",
        "| link Gbit/s (measured) | ZeRO-3 step s | ZeRO++ step s | speedup | x-node MB/rank/step (3 -> ++) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        z3, zp = r["zero3"], r["zeropp"]
        meas = f"{r['measured_gbps']:.3f}" if r["measured_gbps"] else "n/a"
        out.append(
            f"| {r['gbps']:g} ({meas}) | {z3['step_s']:.3f} | {zp['step_s']:.3f} | "
            f"{r['speedup']:.2f}x | {z3['cross_bytes'] / 1e6:.2f} -> {zp['cross_bytes'] / 1e6:.2f} |"
        )
    out += [
        "",
        "Scaling projection vs measurement (compute = measured step - measured comm wait; link = measured "
        "rate, one uplink per node shared by its ranks, gloo's ring wire; quantization at kernel rates timed here "
        "in one process per rank at once):",
        "",
        "| link Gbit/s | run | measured s | projection s | error | of which quant s | measured x-node MB/rank "
        "| predicted | error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for mode, name in NAMES:
            m, p = r[mode], r[mode]["predicted"]
            out.append(
                f"| {r['gbps']:g} | {name} | {m['step_s']:.3f} | {p['step_s']:.3f} | "
                f"{_pct(p['step_s'], m['step_s'])} | {p['quant_s']:.3f} | {m['cross_bytes'] / 1e6:.2f} | "
                f"{p['cross_bytes'] / 1e6:.2f} | {_pct(p['cross_bytes'], m['cross_bytes'])} |"
            )
    up = [(r, mode, name) for r in rows for mode, name in NAMES if r[mode]["uplink_bytes"] is not None]
    if up:
        out += [
            "",
            "Bytes one node's uplink sent per step (kernel tx counter, headers included) vs the projection's "
            "uplink_bytes (ranks sharing the uplink x pairwise cross bytes per rank):",
            "",
            "| link Gbit/s | run | measured uplink MB | predicted MB | error |",
            "|---|---|---|---|---|",
        ]
        for r, mode, name in up:
            m, p = r[mode]["uplink_bytes"], r[mode]["predicted"]["uplink_bytes"]
            out.append(f"| {r['gbps']:g} | {name} | {m / 1e6:.2f} | {p / 1e6:.2f} | {_pct(p, m)} |")
    else:
        out.append(f"\n(no uplink counter comparison: the runs' summaries have no {UPLINK_KEY!r})")
    out += cpu_table(rows, cores)
    rates = rows[0]["zeropp"]["predicted"]["quant_rates"]
    if rates:
        out.append(
            "\nZeRO++ quantization ops as charged (GB/s of fp32 input): "
            + ", ".join(f"{op} int{b} {g:.3f}" for op, b, g in rates)
        )
    sp = [(r["zero3"]["predicted"]["step_s"] / r["zeropp"]["predicted"]["step_s"], r["speedup"]) for r in rows]
    out.append(
        "\npredicted vs measured speedup: "
        + ", ".join(f"{r['gbps']:g} Gbit/s {p:.2f}x vs {m:.2f}x" for r, (p, m) in zip(rows, sp))
    )
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.bench_cluster", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--gbps",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[0.1, 0.5, 2.0],
        help="comma-separated cross-node rates, Gbit/s (default 0.1,0.5,2)",
    )
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--latency-ms", type=float, default=0.0, help="one-way cross-node latency (needs netem)")
    p.add_argument("--preset", default="medium", help="zeropp.models GPT preset (the runner's model=)")
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per rank per step")
    p.add_argument(
        "--coalesce",
        type=int,
        default=0,
        help="zero.coalesce_numel of both modes: consecutive blocks of up to this many elements share one "
        "gather and one reduce-scatter (default 0: one unit per block)",
    )
    p.add_argument(
        "--keep-at-turn",
        action="store_true",
        help="zero.keep_at_turn of both modes: the root and the last block stay gathered from forward into "
        "backward (no backward gather of either)",
    )
    p.add_argument("--steps", type=int, default=4, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=1, help="steps left out of each run's averages")
    p.add_argument("--rounds", type=int, default=2, help="alternating ZeRO-3/ZeRO++ runs of each (noise control)")
    p.add_argument("--timeout", type=float, default=600.0, help="per training run, seconds")
    p.add_argument(
        "--out", type=path_text_arg, default=None, help="keep the run directories here (default: a temporary directory)"
    )
    p.add_argument("--json", type=path_text_arg, default=None, help="also write all numbers to this file")
    p.add_argument(
        "--check",
        action="store_true",
        help="check the scaling model: a small grid (default link rates 0.2,1 Gbit/s, 3 rounds, 3 steps), "
        "predicted vs measured step time per cell, exit 1 unless all are within --tolerance",
    )
    p.add_argument(
        "--cluster-file",
        default=None,
        help="a calibrated cluster file (python -m experiments.bench_comm --calibrate FILE): the predictions use "
        "its latencies, intra-node rate and quantization rates instead of the hand-set constants",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=100 * CHECK_TOLERANCE,
        help="--check's pass bound on every cell's |step-time error|, percent (default %(default)g)",
    )
    raw = list(sys.argv[1:] if argv is None else argv)
    a = p.parse_args(raw)
    if a.check:  # the grid's defaults, unless given explicitly
        for name, value in CHECK_GRID.items():
            if not any(x == f"--{name}" or x.startswith(f"--{name}=") for x in raw):
                setattr(a, name, value)
    check_run_lengths(p, a, ("nodes", "ranks_per_node", "micro_batch", "steps", "rounds"))
    if not a.tolerance > 0:
        p.error(f"--tolerance must be a percentage > 0, got {a.tolerance}")
    if a.coalesce < 0:
        p.error(f"--coalesce must be >= 0 elements, got {a.coalesce}")
    if a.nodes < 2:  # the runner would refuse each job alike (one node: no link to shape)
        p.error(f"--nodes {a.nodes}: the emulated cluster shapes the links between nodes; give --nodes >= 2")
    for g in a.gbps:  # every rate is checked before the first run, not by tc when its run builds the cluster
        if why := link_problem(g, a.latency_ms, gbps_key="--gbps", latency_key="--latency-ms"):
            p.error(why)
    check_fresh_out(p, a.out, [*(["local"] if a.check else []), *(f"{g:g}gbps" for g in a.gbps)])
    check_json_output(p, a.json, "--json", json_with_keys("args", "rows"))
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        cf = read_cluster_file(a.cluster_file) if a.cluster_file else None
    except ClusterFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        require_privileges()
    except (ClusterPrivilegeError, NetnsError) as e:
        print(
            f"error: {e}\n(this benchmark exists to cross a shaped link, so it needs the emulator; an unshaped "
            "comparison: python -m experiments.run cluster=local stage=3 quant=none, then quant=zeropp)",
            file=sys.stderr,
        )
        return 2
    try:
        with tempfile.TemporaryDirectory(prefix="bench_cluster-") as tmp:
            rows = run(a, Path(a.out or tmp), cf)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RankFailure as e:
        print(f"error: a benchmark run failed: {e}", file=sys.stderr)
        return 1
    print(format_rows(rows, a))
    ok = True
    if a.check:
        text, ok = format_check(check_cells(rows), tolerance=a.tolerance / 100)
        consts = f"links from {a.cluster_file}" if cf else "hand-set link constants"
        print(
            f"\nScaling model check, {consts} (load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} at the end):\n"
        )
        print(text)
        if cf is not None:
            hand = check_cells(rows, "predicted_handset")
            print("\nThe same runs with the hand-set constants:\n")
            print(format_check(hand, tolerance=a.tolerance / 100)[0])
            print("\n" + compare_constants(check_cells(rows), hand))
    if a.json:
        write_output_file(Path(a.json), json.dumps({"args": vars(a), "rows": rows}, indent=1))
    return 0 if ok else 1


def cli() -> NoReturn:
    """The command: :func:`main`, ended by ``launch.command.run_command`` (Ctrl-C or a failed world
    is one ``error:`` line and the shell's exit status, never a traceback)."""
    run_command(main)


if __name__ == "__main__":
    cli()
