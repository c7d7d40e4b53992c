"""Check the scaling cost model against measured runs (their ``summary.json``).

Bytes are compared exactly (the model's message sizes against zeropp's CommStats), step time
through the communication wait: each run's compute time is its measured step time minus its
measured wait, so the step-time error is the error of the communication model alone. On CPU
ranks the per-message overhead (gloo, 4 processes on 2 cores) dominates small models, so
:func:`calibrate` fits it (and the loopback rate) by least squares before predicting;
``cluster=emulated`` runs record the shaped link's measured rate, which fixes the cross-node rate.

Quantization is charged, not assumed free: ``calibration.measure_quant_rates`` times zeropp.kernels'
quantize / dequantize ops on this machine at exactly the run's per-rank shapes, and the
prediction adds that time (the engine's measured wait includes it, so the run's compute time
= step - engine wait excludes it). The emulator has one uplink per node shared by the node's
ranks (``nics_per_node=1``): gloo sends pairwise, so the uplink carries ranks_per_node x each
rank's cross-node bytes.

``python -m experiments.scaling_check DIR [--calibrate]`` compares every ``summary.json`` under
DIR (e.g. a ``cluster=emulated`` multirun) with the model's prediction.
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Any, Iterable, NoReturn

from zeropp.comm.spec import QuantSpec
from zeropp.output_files import path_text_arg

from ..launch.command import run_command
from .calibration import measure_quant_rates
from .cluster_file import GBPS_RANGE
from .scaling import control_messages, gpt_units, link_terms, messages, project, quant_time, quant_work
from .spec import GBPS, Cluster, Workload
from .step_schedule import message_transfer
from .text_table import Column, number, text_table

EMULATOR_LINKS: dict[str, Any] = dict(
    intra_gbps=20.0, alpha_cross_s=100e-6, alpha_intra_s=50e-6, nics_per_node=1, parallel_links=True, wire="ring"
)
"""Link constants of an emulated (CPU, gloo) cluster: loopback rate and per-message overheads
(uncalibrated defaults; ``bench_cluster --check`` measures the loopback rate), one shared uplink
per node, and gloo's ring schedule for all-gathers and reduce-scatters on the wire
(``Cluster.wire``). Intra- and cross-node transfers overlap (``parallel_links``): the shaped
uplink drains on its own while the ranks copy over the loopback -- with the loopback at its
measured ~2 Gbit/s per rank, adding the two overstated ZeRO-3's step at 1 Gbit/s by 27-40%."""


def emulator_cluster(nodes: int, ranks_per_node: int, gbps: float, **kw: Any) -> Cluster:
    """The :class:`Cluster` of an emulated run at link rate ``gbps`` (:data:`EMULATOR_LINKS`, overridable)."""
    return Cluster(nodes=nodes, ranks_per_node=ranks_per_node, cross_gbps=gbps, **{**EMULATOR_LINKS, **kw})


def calibrate_cpu_side(
    w: Workload, nodes: int, ranks_per_node: int, *, wait_s: float, loopback_gbps: float, **links: float
) -> dict[str, float]:
    """The CPU-side constants of an emulated run, from the same job's link-free run
    (``cluster=local``: every byte crosses the loopback, so its communication wait ``wait_s`` is
    all CPU work). The scheduled model's CPU side of a step (``step_schedule.message_transfer``
    on a ``comm_on_compute`` cluster: the :data:`EMULATOR_LINKS` latencies plus a copy of every
    sent byte at the measured ``loopback_gbps``, and the control messages' latency) is scaled by
    ``scale`` so that it plus the quantization time equals ``wait_s``. Returns ``{"scale",
    "alpha_cross_s", "alpha_intra_s", "intra_gbps"}``: the scaled constants for
    :func:`emulator_cluster` (latencies times ``scale``, copy rate over it). ``links``: other
    latencies than :data:`EMULATOR_LINKS`' (``alpha_cross_s``, ``alpha_intra_s``, e.g. a
    calibrated cluster file's) to scale."""
    if wait_s < 0 or loopback_gbps <= 0:
        raise ValueError(f"need a wait >= 0 s and a loopback rate > 0 Gbit/s, got {wait_s}, {loopback_gbps}")
    c = emulator_cluster(
        nodes, ranks_per_node, loopback_gbps, **{**links, "intra_gbps": loopback_gbps, "comm_on_compute": True}
    )
    cpu = sum(message_transfer(m, c).compute_s * m.count for m in messages(w, c))
    cpu += control_messages(w, c) * c.alpha_cross_s
    rest = wait_s - quant_time(w, c)
    scale = max(rest, 0.0) / cpu if cpu > 0 else 0.0
    return {
        "scale": scale,
        "alpha_cross_s": c.alpha_cross_s * scale,
        "alpha_intra_s": c.alpha_intra_s * scale,
        "intra_gbps": loopback_gbps / scale if scale > 0 else float("inf"),
    }


def comm_wait_s(summary: dict) -> float | None:
    """The run's time blocked on communication per step: the engine's own measure where there is
    one (it includes quantization), else CommWatch's."""
    eng = summary.get("engine_comm_wait_s_per_step")
    return eng if eng is not None else summary.get("comm_wait_s_per_step")


def _spec(d: dict | None) -> QuantSpec | None:
    return None if d is None else QuantSpec(**d)


def summary_units(summary: dict) -> tuple[int, ...]:
    """A run's communication units from generic summary fields: zeropp's GPT (``mlp_ratio`` in its
    model config) exactly by :func:`gpt_units`; any other model (HF GPT-2/Llama, whose config has
    ``intermediate_size`` instead) as its token embedding (``vocab_size x d_model``) plus
    ``n_layers`` equal blocks sharing the rest of ``summary["model"]["params"]`` (the remainder of
    the split goes to the root). Per-unit sizes only shift latency terms; the total is exact."""
    m = summary["config"]["model"]
    if "mlp_ratio" in m:
        return gpt_units(
            vocab=m["vocab_size"],
            seq_len=m["seq_len"],
            d_model=m["d_model"],
            n_layers=m["n_layers"],
            mlp_ratio=m["mlp_ratio"],
        )
    total = int(summary["model"]["params"])
    layers = int(m.get("n_layers") or 0)
    root = min(int(m.get("vocab_size", 0)) * int(m.get("d_model", 0)), total)
    if layers < 1:
        return (total,)
    block = (total - root) // layers
    return (total - block * layers, *([block] * layers))


def workload_from_summary(summary: dict, quant_rates: tuple[tuple[str, int, float], ...] = ()) -> Workload:
    """The Workload of a measured run: its model's units, its ZeRO settings
    (``summary["config"]["zero"]``, i.e. ``asdict(ZeroConfig)``), its own compute time (measured
    step time minus measured time blocked on communication, quantization included) and the
    quantization rates to charge (:func:`measure_quant_rates`)."""
    cfg = summary["config"]
    m, z = cfg["model"], cfg["zero"]
    compute = max(summary["step_time_s"]["mean"] - (comm_wait_s(summary) or 0.0), 0.0)
    zero = types.SimpleNamespace(**{**z, "weights": _spec(z.get("weights")), "grads": _spec(z.get("grads"))})
    units = summary_units(summary)
    return Workload.from_zero(
        zero,
        units=units,
        compute_s=compute,
        tokens_per_rank=cfg["train"]["micro_batch_size"] * z["grad_accum_steps"] * m["seq_len"],
        flops_per_token=summary["model"]["flops_per_token"],
        quant_rates=tuple(quant_rates),
    )


def _is_zeropp(summary: dict) -> bool:
    """The model describes ZeroEngine's messages: trainer=zeropp runs only."""
    return summary["config"]["trainer"]["name"] == "zeropp"


def link_gbps(summary: dict) -> float | None:
    """The cross-node rate of a run: the emulator's measured rate (``summary["placement"]``), else
    its configured ``cluster.inter_gbps``; None for a cluster=local run (no shaped link)."""
    cfg = summary["config"]
    if cfg["cluster"]["name"] != "emulated":
        return None
    measured = (summary.get("placement") or {}).get("measured_gbps")
    key, rate = (
        ("placement.measured_gbps", measured)
        if measured
        else ("config.cluster.inter_gbps", cfg["cluster"].get("inter_gbps"))
    )
    lo, hi = GBPS_RANGE  # a summary is read from disk: a rate the model cannot use is named, not divided by
    if not (isinstance(rate, (int, float)) and not isinstance(rate, bool) and math.isfinite(rate) and lo <= rate <= hi):
        raise ValueError(
            f"run {summary.get('run_dir')}: {key}={rate!r} is not a link rate ({lo:g} to {hi:g} Gbit/s); its "
            "summary.json is damaged: re-run it, or give the rate with --cross-gbps"
        )
    return float(rate)


def _measured_cluster(s: dict, cross_gbps: float | None, intra_gbps: float, alpha_s: float) -> Cluster:
    cfg = s["config"]
    bw = cross_gbps if cross_gbps is not None else link_gbps(s)
    if bw is None:
        raise ValueError(
            f"run {s.get('run_dir')} is cluster=local: give its cross-node rate (cross_gbps, "
            "--cross-gbps on the command line)"
        )
    topo = cfg["topology"]
    return emulator_cluster(
        topo["nodes"], topo["ranks_per_node"], bw, intra_gbps=intra_gbps, alpha_cross_s=alpha_s, alpha_intra_s=alpha_s
    )


def _rates_for(
    summaries: list[dict], cross_gbps: float | None, quant_rates: tuple[tuple[str, int, float], ...] | None
) -> dict[int, tuple]:
    """Quantization rates per run (index): the given ones, else measured here once per shape."""
    out: dict[int, tuple] = {}
    cache: dict[tuple, tuple] = {}
    for i, s in enumerate(summaries):
        if not _is_zeropp(s):
            continue
        if quant_rates is not None:
            out[i] = tuple(quant_rates)
            continue
        w, c = workload_from_summary(s), _measured_cluster(s, cross_gbps, 1.0, 0.0)
        key = (dataclasses.replace(w, compute_s=0.0, tokens_per_rank=0, flops_per_token=0.0), c)
        if not quant_work(w, c):
            out[i] = ()
            continue
        if key not in cache:
            cache[key] = measure_quant_rates(w, c)
        out[i] = cache[key]
    return out


def calibrate(
    summaries: Iterable[dict],
    *,
    cross_gbps: float | None = None,
    quant_rates: tuple[tuple[str, int, float], ...] | None = None,
) -> dict[str, float]:
    """Fit the two constants a CPU run cannot know in advance: the per-message-step latency (gloo
    and scheduling overhead) and the intra-node (loopback) rate, by least squares on the measured
    communication wait minus the charged link and quantization time, with the cross-node rate
    fixed to the emulator's link. ``quant_rates`` as in :func:`compare_measured`. Returns
    ``{"alpha_s", "intra_gbps"}`` for :func:`compare_measured`."""
    summaries = list(summaries)
    return _fit(summaries, cross_gbps, _rates_for(summaries, cross_gbps, quant_rates))


def _fit(summaries: list[dict], cross_gbps: float | None, rates: dict[int, tuple]) -> dict[str, float]:
    import numpy as np

    rows, ys = [], []
    for i, s in enumerate(summaries):
        wait_s = comm_wait_s(s)
        if not _is_zeropp(s) or wait_s is None:
            continue
        c = _measured_cluster(s, cross_gbps, 1.0, 0.0)
        w = workload_from_summary(s, rates[i])
        steps = cross_s = intra_b = 0.0
        for m in messages(w, c):
            st, tx, ib = link_terms(m, c)
            steps, cross_s, intra_b = steps + st * m.count, cross_s + tx * m.count, intra_b + ib * m.count
        rows.append([steps, intra_b])
        ys.append(wait_s - cross_s - quant_time(w, c))
    if not rows:
        raise ValueError("no trainer=zeropp run with a measured communication wait to calibrate on")
    (alpha, inv_bw), *_ = np.linalg.lstsq(np.array(rows, dtype=float), np.array(ys, dtype=float), rcond=None)
    alpha, inv_bw = max(float(alpha), 0.0), max(float(inv_bw), 1e-15)
    return {"alpha_s": alpha, "intra_gbps": 1.0 / inv_bw / GBPS}


def _ratio_error(predicted: float, measured: float) -> float:
    """``predicted / measured - 1``; 0 when both are 0 (a one-node run sends no cross-node bytes and
    the model predicts none: exact), NaN when only the measurement is 0."""
    if measured:
        return predicted / measured - 1
    return 0.0 if not predicted else math.nan


def compare_measured(
    summaries: Iterable[dict],
    *,
    cross_gbps: float | None = None,
    intra_gbps: float = 20.0,
    alpha_s: float = 100e-6,
    calibrated: bool = False,
    quant_rates: tuple[tuple[str, int, float], ...] | None = None,
) -> list[dict]:
    """Predicted vs measured step time and bytes for each run (trainer=zeropp runs only).

    ``cross_gbps`` defaults to the emulator's measured (else configured) link rate recorded in the
    run's summary and must be given for cluster=local runs. ``calibrated=True`` first fits
    ``alpha_s`` and ``intra_gbps`` on these same runs (:func:`calibrate`); for an out-of-sample
    check, calibrate on some runs and pass the result to a comparison of others. The compute
    time of each run is its own measured step time minus its measured communication wait, so
    the step-time error is the error of the communication model. Bytes are exact: 0 error
    means the model's message sizes are what the engine sent. Quantization is charged at
    ``quant_rates`` (``Workload.quant_rates``), by default measured on this machine at each run's
    shapes (:func:`measure_quant_rates`); ``()`` charges ``Workload.quant_gbs`` for every op.
    """
    summaries = list(summaries)
    rates = _rates_for(summaries, cross_gbps, quant_rates)
    if calibrated:
        fit = _fit(summaries, cross_gbps, rates)
        alpha_s, intra_gbps = fit["alpha_s"], fit["intra_gbps"]
    rows = []
    for i, s in enumerate(summaries):
        if not _is_zeropp(s):
            continue
        c = _measured_cluster(s, cross_gbps, intra_gbps, alpha_s)
        p = project(workload_from_summary(s, rates[i]), c)
        measured_step = s["step_time_s"]["mean"]
        eng = s.get("engine_comm_bytes_per_step") or s["comm_bytes_per_step"]
        meas_cross, meas_intra = eng["by_link"]["cross"], eng["by_link"]["intra"]
        pred_cross = sum(v for k, v in p.pairwise.items() if k.endswith(".cross"))
        pred_intra = sum(v for k, v in p.pairwise.items() if k.endswith(".intra"))
        rows.append(
            {
                "label": s["label"],
                "run_dir": s.get("run_dir"),
                "cross_gbps": c.cross_gbps,
                "alpha_s": alpha_s,
                "intra_gbps": intra_gbps,
                "measured_step_s": measured_step,
                "predicted_step_s": p.step_s,
                "step_error": p.step_s / measured_step - 1 if measured_step else math.nan,
                "measured_comm_s": comm_wait_s(s),
                "predicted_comm_s": p.comm_s,
                "predicted_quant_s": p.quant_s,
                "measured_cross_bytes": meas_cross,
                "predicted_cross_bytes": pred_cross,
                "bytes_error": _ratio_error(pred_cross, meas_cross),
                "measured_intra_bytes": meas_intra,
                "predicted_intra_bytes": pred_intra,
                "intra_bytes_error": _ratio_error(pred_intra, meas_intra),
            }
        )
    return rows


COMPARISON_COLUMNS = (
    Column(title="run", width=34, left=True, cell=lambda r: r["label"]),
    Column(title="meas s", width=8, cell=number("measured_step_s", ".3f")),
    Column(title="pred s", width=8, cell=number("predicted_step_s", ".3f")),
    Column(title="err", width=7, cell=number("step_error", ".0f", scale=100, suffix="%")),
    Column(title="quant s", width=8, cell=number("predicted_quant_s", ".3f")),
    Column(title="meas x-B", width=10, cell=number("measured_cross_bytes", ".0f")),
    Column(title="pred x-B", width=10, cell=number("predicted_cross_bytes", ".0f")),
    Column(title="err", width=7, cell=number("bytes_error", ".1f", scale=100, suffix="%")),
)
"""The columns of :func:`format_comparison` (the rows of :func:`compare_measured`)."""


def comparison_columns(rows: list[dict]) -> tuple[Column, ...]:
    """:data:`COMPARISON_COLUMNS` with the run column as wide as the longest label of ``rows``
    (a label is never cut: cut, two runs can read alike)."""
    width = max([COMPARISON_COLUMNS[0].width, *(len(r["label"]) for r in rows)])
    return (dataclasses.replace(COMPARISON_COLUMNS[0], width=width), *COMPARISON_COLUMNS[1:])


def format_comparison(rows: list[dict]) -> str:
    return text_table(comparison_columns(rows), rows)


def name_apart(rows: list[dict], summaries: list[dict]) -> None:
    """Rows whose runs share a ``label`` (``ZeRO-3 tiny 1x2`` for runs of other steps, seeds or
    bucket sizes) get what tells their runs apart appended (``labels.label_runs``), so no
    two rows read alike; ``summaries``: the rows' runs, in order."""
    from collections import Counter

    from .labels import label_runs

    counts = Counter(r["label"] for r in rows)
    if len(rows) != len(summaries) or max(counts.values(), default=0) < 2:
        return
    for r, apart in zip(rows, label_runs(summaries).labels):
        if counts[r["label"]] > 1:
            r["label"] = f"{r['label']} ({apart})"


def links_line(rows: list[dict]) -> str:
    """The links the rows were predicted with. Runs of a link-rate sweep (``cluster=emulated
    cluster.inter_gbps=1,10``) each use their own cross-node rate: then every row's label ends with
    it and the line lists them all (one rate named for all rows would mislabel the others)."""
    rates = sorted({r["cross_gbps"] for r in rows})
    if len(rates) > 1:
        for r in rows:
            r["label"] = f"{r['label']} @ {r['cross_gbps']:.3g} Gbit/s"
    cross = ", ".join(f"{g:.3g}" for g in rates) + (" Gbit/s (per run: see each row)" if len(rates) > 1 else " Gbit/s")
    return (
        f"links: cross {cross}, intra {rows[0]['intra_gbps']:.3g} Gbit/s, "
        f"{1e6 * rows[0]['alpha_s']:.0f} us per message step"
    )


def _job_order(path: Any) -> tuple:
    """A multirun's jobs (``<sweep>/<n>/summary.json``) in Hydra's job order (2 before 10)."""
    name = path.parent.name
    return (str(path.parent.parent), int(name), "") if name.isdigit() else (str(path.parent.parent), -1, name)


SUMMARY_KEYS = ("label", "config", "step_time_s", "comm_bytes_per_step")
"""The keys of a run's ``summary.json`` that every comparison reads."""


def main(argv: list[str] | None = None) -> None:
    import argparse
    from pathlib import Path

    from zeropp.input_files import read_json

    from .flags import link_rate, non_negative

    ap = argparse.ArgumentParser(prog="python -m experiments.scaling_check", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "runs", type=path_text_arg, metavar="DIR", help="check the model against every summary.json under DIR"
    )
    ap.add_argument("--cross-gbps", type=link_rate, default=None, help="link rate of cluster=local runs, Gbit/s")
    ap.add_argument("--intra-gbps", type=link_rate, default=20.0, help="intra-node (loopback) rate, Gbit/s")
    ap.add_argument("--alpha", type=non_negative, default=100e-6, help="seconds per message step")
    ap.add_argument("--calibrate", action="store_true", help="fit --alpha and --intra-gbps on these runs first")
    a = ap.parse_args(argv)
    paths = sorted(Path(a.runs).rglob("summary.json"), key=_job_order)
    if not paths:
        ap.exit(2, f"error: no summary.json under {a.runs}; point at a run or multirun directory\n")
    summaries = []
    for p in paths:
        try:
            summary = read_json(p)
        except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8
            ap.exit(2, f"error: {p} cannot be read as a run's summary ({e}); move it away or repair it\n")
        missing = [k for k in SUMMARY_KEYS if k not in summary] if isinstance(summary, dict) else list(SUMMARY_KEYS)
        if missing:
            ap.exit(
                2, f"error: {p} has no {', '.join(missing)}; it is not a run's summary: move it away or repair it\n"
            )
        summary["run_dir"] = str(p.parent)  # where it is now (a run moved or copied names its new place)
        summaries.append(summary)
    try:
        rows = compare_measured(
            summaries, cross_gbps=a.cross_gbps, intra_gbps=a.intra_gbps, alpha_s=a.alpha, calibrated=a.calibrate
        )
    except ValueError as e:  # a cluster=local run without --cross-gbps, a summary's damaged link rate
        ap.exit(2, f"error: {e}\n")
    name_apart(rows, [s for s in summaries if _is_zeropp(s)])
    if rows:
        print(links_line(rows))
    print(format_comparison(rows))


def cli() -> NoReturn:
    """The command: :func:`main`, ended by ``launch.command.run_command`` (Ctrl-C or a failed world
    is one ``error:`` line and the shell's exit status, never a traceback)."""
    run_command(main)


if __name__ == "__main__":
    cli()
