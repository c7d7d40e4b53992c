"""Check the scaling cost model against measured runs (their ``summary.json``).

Bytes are compared exactly (the model's message sizes against zeropp's CommStats), step time
through the communication wait: each run's compute time is its measured step time minus its
measured wait, so the step-time error is the error of the communication model alone. On CPU
ranks the per-message overhead (gloo, 4 processes on 2 cores) dominates small models, so
:func:`calibrate` fits it (and the loopback rate) by least squares before predicting;
``cluster=emulated`` runs record the shaped link's measured rate, which fixes the cross-node rate.
"""

from __future__ import annotations

import math
from typing import Iterable

from zeropp.kernels import DEFAULT_GRAD_GROUP_SIZE, DEFAULT_WEIGHT_GROUP_SIZE

from .scaling import GBPS, Cluster, Workload, _terms, gpt_units, messages, project


def workload_from_summary(summary: dict) -> Workload:
    """The Workload of a measured run: its model's units, its switches, and its own compute time
    (measured step time minus measured time blocked on communication)."""
    cfg = summary["config"]
    m, z, t = cfg["model"], summary["zero"]["effective"], cfg["train"]
    step = summary["step_time_s"]["mean"]
    compute = max(step - (summary.get("comm_wait_s_per_step") or 0.0), 0.0)
    return Workload(
        units=gpt_units(vocab=m["vocab_size"], seq_len=m["seq_len"], d_model=m["d_model"],
                        n_layers=m["n_layers"], mlp_ratio=m["mlp_ratio"]),
        compute_s=compute, tokens_per_rank=t["micro_batch_size"] * t["grad_accum"] * m["seq_len"],
        stage=z["stage"], qwz_bits=z["qwz_bits"], hpz=z["hpz"], hpz_size=z.get("hpz_size"),
        qgz_bits=z["qgz_bits"], qgz_intra_bits=z.get("qgz_intra_bits"),
        qwz_group_size=z.get("qwz_group_size") or DEFAULT_WEIGHT_GROUP_SIZE,
        qgz_group_size=z.get("qgz_group_size") or DEFAULT_GRAD_GROUP_SIZE,
        dtype_bytes=4 if t["precision"] == "fp32" else 2, grad_accum=t["grad_accum"],
        flops_per_token=summary["model"]["flops_per_token"],
        quant_gbs=math.inf)  # quantization already sits inside the measured compute time


def _measured_cluster(s: dict, cross_gbps: float | None, intra_gbps: float, alpha_s: float) -> Cluster:
    cfg = s["config"]
    placement = s.get("placement") or {}
    bw = cross_gbps if cross_gbps is not None else (
        placement.get("measured_gbps") or cfg["cluster"]["inter_gbps"] if cfg["cluster"]["name"] == "emulated" else None)
    if bw is None:
        raise ValueError(f"run {s.get('run_dir')} is cluster=local: pass cross_gbps for its links")
    topo = s["topology"]
    return Cluster(nodes=topo["nodes"], ranks_per_node=topo["ranks_per_node"], cross_gbps=bw, intra_gbps=intra_gbps,
                   alpha_cross_s=alpha_s, alpha_intra_s=alpha_s, parallel_links=False)


def calibrate(summaries: Iterable[dict], *, cross_gbps: float | None = None) -> dict[str, float]:
    """Fit the two constants a CPU run cannot know in advance: the per-message-step latency (gloo
    and scheduling overhead) and the intra-node (loopback) rate, by least squares on the measured
    communication wait, with the cross-node rate fixed to the emulator's link. Returns
    ``{"alpha_s", "intra_gbps"}`` for :func:`compare_measured`."""
    import numpy as np

    rows, ys = [], []
    for s in summaries:
        if s.get("trainer") != "zeropp" or s.get("comm_wait_s_per_step") is None:
            continue
        c = _measured_cluster(s, cross_gbps, 1.0, 0.0)
        steps = cross_s = intra_b = 0.0
        for m in messages(workload_from_summary(s), c):
            st, tx, ib = _terms(m, c)
            steps, cross_s, intra_b = steps + st * m.count, cross_s + tx * m.count, intra_b + ib * m.count
        rows.append([steps, intra_b])
        ys.append(s["comm_wait_s_per_step"] - cross_s)
    if not rows:
        raise ValueError("no trainer=zeropp run with a measured communication wait to calibrate on")
    (alpha, inv_bw), *_ = np.linalg.lstsq(np.array(rows, dtype=float), np.array(ys, dtype=float), rcond=None)
    alpha, inv_bw = max(float(alpha), 0.0), max(float(inv_bw), 1e-15)
    return {"alpha_s": alpha, "intra_gbps": 1.0 / inv_bw / GBPS}


def compare_measured(summaries: Iterable[dict], *, cross_gbps: float | None = None, intra_gbps: float = 20.0,
                     alpha_s: float = 100e-6, calibrated: bool = False) -> list[dict]:
    """Predicted vs measured step time and bytes for each run (trainer=zeropp runs only).

    ``cross_gbps`` defaults to the emulator's measured (else configured) link rate recorded in the
    run's summary and must be given for cluster=local runs. ``calibrated=True`` first fits
    ``alpha_s`` and ``intra_gbps`` on these same runs (:func:`calibrate`); for an out-of-sample
    check, calibrate on some runs and pass the result to a comparison of others. The compute
    time of each run is its own measured step time minus its measured communication wait, so
    the step-time error is the error of the communication model. Bytes are exact: 0 error
    means the model's message sizes are what the engine sent.
    """
    summaries = list(summaries)
    if calibrated:
        fit = calibrate(summaries, cross_gbps=cross_gbps)
        alpha_s, intra_gbps = fit["alpha_s"], fit["intra_gbps"]
    rows = []
    for s in summaries:
        if s.get("trainer") != "zeropp":
            continue
        c = _measured_cluster(s, cross_gbps, intra_gbps, alpha_s)
        p = project(workload_from_summary(s), c)
        measured_step = s["step_time_s"]["mean"]
        eng = s.get("engine_comm_bytes_per_step") or s["comm_bytes_per_step"]
        meas_cross, meas_intra = eng["by_link"]["cross"], eng["by_link"]["intra"]
        pred_cross = sum(v for k, v in p.pairwise.items() if k.endswith(".cross"))
        pred_intra = sum(v for k, v in p.pairwise.items() if k.endswith(".intra"))
        rows.append({
            "label": s["label"], "run_dir": s.get("run_dir"), "cross_gbps": c.cross_gbps, "alpha_s": alpha_s,
            "intra_gbps": intra_gbps, "measured_step_s": measured_step, "predicted_step_s": p.step_s,
            "step_error": p.step_s / measured_step - 1 if measured_step else math.nan,
            "measured_comm_s": s.get("comm_wait_s_per_step"), "predicted_comm_s": p.comm_s,
            "measured_cross_bytes": meas_cross, "predicted_cross_bytes": pred_cross,
            "bytes_error": pred_cross / meas_cross - 1 if meas_cross else math.nan,
            "measured_intra_bytes": meas_intra, "predicted_intra_bytes": pred_intra,
            "intra_bytes_error": pred_intra / meas_intra - 1 if meas_intra else math.nan,
        })
    return rows


def format_comparison(rows: list[dict]) -> str:
    head = f"{'run':<34} {'meas s':>8} {'pred s':>8} {'err':>7} {'meas x-B':>10} {'pred x-B':>10} {'err':>7}"
    out = [head, "-" * len(head)]
    for r in rows:
        out.append(f"{r['label'][:34]:<34} {r['measured_step_s']:>8.3f} {r['predicted_step_s']:>8.3f} "
                   f"{100 * r['step_error']:>6.0f}% {r['measured_cross_bytes']:>10.0f} "
                   f"{r['predicted_cross_bytes']:>10.0f} {100 * r['bytes_error']:>6.1f}%")
    return "\n".join(out)
