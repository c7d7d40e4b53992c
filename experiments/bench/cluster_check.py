"""``python -m experiments.bench_cluster``'s model side: each measured cell's predictions and the
``--check`` verdict.

:func:`predict` puts the cost model beside one bandwidth's measurements (serial, scheduled and
measured-CPU-plus-modelled-link predictions, each with compute = the run's measured step - its
measured wait), :func:`quant_rates_for` the quantization rates it charges, and
:func:`check_cells` / :func:`format_check` the per-cell errors against :data:`CHECK_TOLERANCE`.
The runs themselves and the main table are ``cluster.py``'s.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ..projection.calibration import measure_quant_rates, measure_quant_rates_contended
from ..projection.cluster_file import ClusterFile, merge_rates
from ..projection.scaling import project, quant_work
from ..projection.scaling_check import calibrate_cpu_side, emulator_cluster, workload_from_summary
from ..projection.spec import GBPS
from ..projection.step_schedule import project_scheduled

MODES = {"zero3": "none", "zeropp": "zeropp"}
"""Benchmark mode -> the runner's ``quant=`` recipe (both at stage 3)."""


def predict(
    m: dict[str, Any],
    summary: dict[str, Any],
    gbps: float,
    rates: tuple[tuple[str, int | str, float], ...] | None = None,
    local: dict[str, float] | None = None,
    cluster_file: ClusterFile | None = None,
) -> dict[str, Any]:
    """The scaling model's step time and bytes for the measured mode ``m`` (one of its runs'
    ``summary`` gives the workload; compute = the median step minus the median comm wait; one
    uplink per node shared by the node's ranks, gloo's ring schedule on the wire; link constants
    of ``scaling_check.EMULATOR_LINKS``).

    Quantization is charged at ``rates`` (``Workload.quant_rates``; :func:`quant_rates_for` times
    them with one process per rank at once); None: timed here in one process (one thread) and
    scaled by the share of a core each rank had (cores / ranks when the ranks outnumber the cores).

    ``local`` (``--check``): ``{"comm_wait_s", "loopback_gbps"}`` of the same job on an unshaped
    ``cluster=local`` world and this host's measured loopback rate. Then also ``hybrid_step_s``:
    the CPU side measured, the link modelled. The shaped link drains on its own (tbf) while the
    ranks' CPUs quantize, copy and compute, and the engine prefetches gathers and keeps
    reduce-scatters in flight, so the two overlap: the wait is the longer of the unshaped run's
    wait and the model's uplink time at ``gbps`` (:func:`~experiments.projection.scaling.uplink_bytes`). And
    ``scheduled_step_s`` (with ``cpu_scale``): :func:`~experiments.projection.step_schedule.project_scheduled`
    on a ``comm_on_compute`` emulator cluster whose CPU-side constants are calibrated on the
    unshaped wait (:func:`~experiments.projection.scaling_check.calibrate_cpu_side`), with the run's
    ``prefetch_depth``.

    ``cluster_file`` (``--cluster-file``): its figures replace the guesses, not what this check
    measures at the time of its runs. Its per-message latencies replace
    :data:`~experiments.projection.scaling_check.EMULATOR_LINKS`' in every prediction; its
    intra-node rate and ``(op, format)`` quantization rates stand in only where nothing was
    measured (no unshaped reference: the loopback; ``rates`` None: the kernels), since a host's
    load moves both between the calibration and the check; the cross-node rate stays the
    cell's probed one (each cell shapes its own)."""
    topo = summary["config"]["topology"]
    links = {k: v for k, v in (cluster_file.link_overrides() if cluster_file else {}).items() if k != "cross_gbps"}
    if local is not None:
        links["intra_gbps"] = local["loopback_gbps"]  # measured, not the default nor the file's
    c = emulator_cluster(topo["nodes"], topo["ranks_per_node"], gbps, **links)
    w = dataclasses.replace(workload_from_summary(summary), compute_s=m["compute_s"])
    if not quant_work(w, c):
        rates = ()
    elif rates is None and cluster_file is not None and cluster_file.quant_rates:
        rates = merge_rates((), cluster_file)
    elif rates is None:
        share = min(1.0, (os.cpu_count() or 1) / c.world)
        rates = tuple((op, b, g * share) for op, b, g in measure_quant_rates(w, c))
    p = project(dataclasses.replace(w, quant_rates=tuple(rates)), c)
    cross = sum(v for k, v in p.pairwise.items() if k.endswith(".cross"))
    out = {
        "step_s": p.step_s,
        "comm_s": p.comm_s,
        "quant_s": p.quant_s,
        "cross_bytes": cross,
        "uplink_bytes": p.uplink_bytes,
        "node_cross_bytes": p.node_cross_bytes,
        "quant_rates": rates,
    }
    if local is not None:
        comm = max(local["comm_wait_s"], p.uplink_bytes / (gbps * GBPS))
        out.update(
            hybrid_comm_s=comm,
            hybrid_step_s=w.compute_s + comm,
            local_comm_wait_s=local["comm_wait_s"],
            loopback_gbps=local["loopback_gbps"],
        )
        wq = dataclasses.replace(w, quant_rates=tuple(rates))
        alphas = {k: v for k, v in links.items() if k.startswith("alpha_")}
        cal = calibrate_cpu_side(
            wq,
            topo["nodes"],
            topo["ranks_per_node"],
            wait_s=local["comm_wait_s"],
            loopback_gbps=local["loopback_gbps"],
            **alphas,
        )
        cs = emulator_cluster(
            topo["nodes"],
            topo["ranks_per_node"],
            gbps,
            comm_on_compute=True,
            **{k: cal[k] for k in ("alpha_cross_s", "alpha_intra_s", "intra_gbps")},
        )
        ps = project_scheduled(wq, cs, prefetch=summary["config"]["zero"].get("prefetch_depth", 1))
        out.update(scheduled_step_s=ps.step_s, cpu_scale=cal["scale"])
    return out


def quant_rates_for(summary: dict[str, Any]) -> tuple[tuple[str, int, float], ...]:
    """Kernel rates of a run's quantization ops, timed right after its jobs in one process per
    rank at once (``calibration.measure_quant_rates_contended``): the same host, the same
    shapes and the same contention as inside the step; () when the run quantizes nothing."""
    topo = summary["config"]["topology"]
    c = emulator_cluster(topo["nodes"], topo["ranks_per_node"], 1.0)
    w = workload_from_summary(summary)
    return measure_quant_rates_contended(w, c) if quant_work(w, c) else ()


CHECK_TOLERANCE = 0.15
"""``--check`` passes when every cell's predicted step time is within this of the measured one."""


CHECK_GRID = {"gbps": [0.2, 1.0], "rounds": 3, "steps": 3, "warmup": 1}
"""``--check``'s defaults (each applies unless given on the command line): ZeRO-3 and ZeRO++ at
two link rates, the median of three alternating runs each (one run reads +-30% on a loaded host;
the same cell read 0.383 s and 0.435 s in two two-run checks of one afternoon)."""


PREDICTIONS = {"scheduled": "scheduled model", "hybrid": "measured CPU + modelled link", "analytic": "serial model"}
"""``--check``'s predictions, the one its verdict is on first (see the module doc)."""


def check_cells(rows: list[dict[str, Any]], key: str = "predicted") -> list[dict[str, Any]]:
    """One cell per (link rate, mode): measured step time and each prediction with its relative
    error (``<name>_s``, ``<name>_error`` for :data:`PREDICTIONS`; the scheduled and hybrid ones
    only when the run measured its unshaped reference). ``key``: which predictions of a mode
    (``predicted``; ``predicted_handset``: the hand-set constants' beside a cluster file's)."""
    cells = []
    for r in rows:
        for mode in MODES:
            m, p = r[mode], r[mode][key]
            meas = m["step_s"]
            cell = {
                "gbps": r["gbps"],
                "measured_gbps": r["measured_gbps"],
                "mode": mode,
                "measured_s": meas,
                "comm_wait_s": m["comm_wait_s"],
                "quant_s": p["quant_s"],
                "local_comm_wait_s": p.get("local_comm_wait_s"),
                "cpu_scale": p.get("cpu_scale"),
            }
            for name, pred in (
                ("analytic", p["step_s"]),
                ("hybrid", p.get("hybrid_step_s")),
                ("scheduled", p.get("scheduled_step_s")),
            ):
                cell[f"{name}_s"] = pred
                cell[f"{name}_error"] = None if pred is None else (pred / meas - 1 if meas else float("nan"))
            cells.append(cell)
    return cells


def _judged(cells: list[dict[str, Any]]) -> tuple[list[str], str]:
    """The predictions every cell has (in :data:`PREDICTIONS`' order) and the one judged."""
    shown = [k for k in PREDICTIONS if cells and all(c[f"{k}_s"] is not None for c in cells)]
    return shown, shown[0] if shown else "analytic"


def format_check(cells: list[dict[str, Any]], tolerance: float = CHECK_TOLERANCE) -> tuple[str, bool]:
    """The ``--check`` table and whether every cell is within ``tolerance``, judged on the first
    prediction of :data:`PREDICTIONS` that every cell has."""
    names = {"zero3": "ZeRO-3", "zeropp": "ZeRO++"}
    shown, key = _judged(cells)
    local = "scheduled" in shown
    out = [
        "| link Gbit/s (measured) | run | measured step s | measured comm wait s |"
        + (" unshaped comm wait s | CPU scale |" if local else "")
        + "".join(f" {PREDICTIONS[k]} s | error |" for k in shown),
        "|---|---|---|---|" + ("---|---|" if local else "") + "---|---|" * len(shown),
    ]
    ok = True
    for c in cells:
        inside = abs(c[f"{key}_error"]) <= tolerance
        ok &= inside
        meas = f"{c['measured_gbps']:.3f}" if c["measured_gbps"] else "n/a"
        line = f"| {c['gbps']:g} ({meas}) | {names[c['mode']]} | {c['measured_s']:.3f} | {c['comm_wait_s']:.3f} |"
        if local:
            line += f" {c['local_comm_wait_s']:.3f} | {c['cpu_scale']:.2f} |"
        line += "".join(f" {c[f'{k}_s']:.3f} | {100 * c[f'{k}_error']:+.1f}% |" for k in shown)
        out.append(line + ("" if inside else " outside"))
    worst = {k: max((abs(c[f"{k}_error"]) for c in cells), default=0.0) for k in shown}
    out.append(
        f"\ncheck ({PREDICTIONS[key]}): {'PASS' if ok else 'FAIL'} -- every cell within "
        f"+-{100 * tolerance:.0f}%: {'yes' if ok else 'no'} (worst {100 * worst.get(key, 0.0):.1f}%, "
        f"{len(cells)} cells)" + "".join(f"; {PREDICTIONS[k]}: worst {100 * worst[k]:.1f}%" for k in shown[1:])
    )
    out.append(f"max |error|: {100 * worst.get(key, 0.0):.1f}% (tolerance {100 * tolerance:g}%)")
    return "\n".join(out), ok


def worst_error(cells: list[dict[str, Any]]) -> tuple[str, float]:
    """``(prediction, max |error|)`` of the prediction :func:`format_check` judges ``cells`` on."""
    _, key = _judged(cells)
    return key, max((abs(c[f"{key}_error"]) for c in cells), default=0.0)


def compare_constants(calibrated: list[dict[str, Any]], handset: list[dict[str, Any]]) -> str:
    """One line: the verdict prediction's worst error with a cluster file's figures against the
    hand-set constants' on the same runs, and whether the file's is no worse."""
    name, cal = worst_error(calibrated)
    _, hand = worst_error(handset)
    verdict = "no worse" if cal <= hand else "WORSE"
    return (
        f"calibrated vs hand-set ({PREDICTIONS[name]}, same runs): worst {100 * cal:.1f}% vs {100 * hand:.1f}% "
        f"-- the cluster file is {verdict}"
    )
