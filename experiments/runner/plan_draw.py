"""The projected step of ``python -m experiments.plan``: the plan and its time model as timeline events.

Why a module of its own: both the plan command (``plan.py``) and the side-by-side of a profiled run
(``plan_measured.py``) project a runner config's step and draw it; the projection lives here so
neither command imports the other.

:func:`project` builds the plan (``zeropp.runtime.plan``) of a config on a node count and replays
it in time (``experiments.projection.step_schedule``); :func:`events` turns the replay into lane events
(:data:`LANES`), :func:`chrome_trace` and :func:`plot` draw them.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zeropp.output_files import holds_tag, json_file_is, tagged_png, write_output_file

from .config import ConfigError, RunConfig

LANES = ("compute", "quantization", "intra link", "cross link")
"""Timeline lanes, top to bottom (CPU ranks' collective work on the compute resource is drawn on
``compute`` with the collective's name)."""


def check_plannable(rc: RunConfig) -> None:
    """ConfigError unless the plan can describe ``rc``'s step (trainer=zeropp, no tensor parallelism)."""
    if not rc.trainer_spec.zero_engine:
        raise ConfigError(
            f"invalid config: trainer={rc.trainer.name}; the plan describes ZeroEngine's step, so use trainer=zeropp"
        )
    if rc.topology.tp > 1:
        raise ConfigError(
            f"invalid config: topology.tp={rc.topology.tp}; the TP-local unit sizes need the split "
            f"model, which this command does not build; plan with topology.tp=1"
        )


def check_modelled(rc: RunConfig) -> None:
    """ConfigError for a setting the projected step leaves out, so that the plan of a config with it
    would be the plan of the config without it, under its name: ZeRO-Offload / ZeRO-Infinity (the
    host optimizer step, the host and disk copies), ZeRO-R's recompute and activation copies. The
    collectives are the same with or without them; the time is not. (The side-by-side of a profiled
    run keeps such runs: there the measured lanes show what the projection leaves out.)"""
    z = rc.zero
    unmodelled = [
        (f"zero.offload_optimizer={z.offload_optimizer}", "zero.offload_optimizer=none", z.offload_optimizer != "none"),
        (f"zero.offload_param={z.offload_param}", "zero.offload_param=none", z.offload_param != "none"),
        ("zero.offload_activations=true", "zero.offload_activations=false", z.offload_activations),
        (
            "train.activation_checkpointing=true",
            "train.activation_checkpointing=false",
            rc.train.activation_checkpointing,
        ),
    ]
    given = [(k, fix) for k, fix, on in unmodelled if on]
    if given:
        raise ConfigError(
            f"invalid config: {', '.join(k for k, _ in given)}: the plan's projected step models the "
            "collectives and the model's compute only, not the host optimizer step and the host/disk "
            "copies of offload or the recompute and activation copies of ZeRO-R, so it would project "
            "this config as if the setting were off. The collectives are the same without it: plan with "
            f"{' '.join(fix for _, fix in given)} (and python -m experiments.bench_offload for the offload costs)"
        )


def model_units(rc: RunConfig) -> tuple:
    """The runner's model's units, from a model built on the meta device."""
    from zeropp.runtime.plan import plan_units

    from .trainers import meta_model

    units = plan_units(meta_model(rc))
    if any(u.frozen for u in units) or not all(u.numel for u in units):
        raise ConfigError(
            "invalid config: the model has frozen parameters (model.lora_rank); the step's timeline "
            "models trainable units only; plan with model.lora_rank=0"
        )
    return units


def project(rc: RunConfig, units: tuple, nodes: int, a: argparse.Namespace) -> dict[str, Any]:
    """The plan and the traced scheduled step of ``rc`` on ``nodes`` nodes."""
    from zeropp.comm import Topology
    from zeropp.runtime.config import validate_against_topology
    from zeropp.runtime.plan import build_plan

    from ..projection.cluster_file import merge_rates
    from ..projection.scaling import control_time
    from ..projection.spec import Cluster, Workload
    from ..projection.step_schedule import Interval, scheduled_step_s, unit_costs

    t = rc.topology
    topo = Topology(nodes=nodes, ranks_per_node=t.ranks_per_node, hpz_size=t.hpz_size)
    try:
        validate_against_topology(rc.zero, topo.world_size, nodes, t.ranks_per_node)
    except ValueError as e:
        raise ConfigError(f"invalid config (zero.* against topology.*): {e}") from None
    plan = build_plan(units, rc.zero, topo)
    # the timeline's units are the plan's (coalesced spans merged by trainable + frozen elements, as
    # the engine merges them), so its unit indices name the plan's units
    numels = tuple(u.numel for u in plan.units)
    tokens = rc.train.micro_batch_size * rc.model.seq_len * rc.zero.grad_accum_steps
    emulated = rc.cluster.name == "emulated"
    c = Cluster(
        nodes=nodes,
        ranks_per_node=t.ranks_per_node,
        cross_gbps=rc.cluster.inter_gbps if emulated else a.gbps,
        nics_per_node=1 if emulated else None,
    )
    w = Workload.from_zero(
        rc.zero,
        units=numels,
        compute_s=6.0 * sum(numels) * tokens / (a.tflops * 1e12),
        tokens_per_rank=tokens,
        coalesce=0,  # (already merged)
    )
    cf = getattr(a, "calibrated", None)  # a calibrated cluster file (``--cluster-file``)
    if cf is not None:
        c, w = cf.cluster(c), dataclasses.replace(w, quant_rates=merge_rates(w.quant_rates, cf))
    trace: list[Interval] = []
    step = scheduled_step_s(
        unit_costs(w, c),
        stage=w.stage,
        micro_batches=w.grad_accum,
        prefetch=rc.zero.prefetch_depth,
        control_s=control_time(w, c),
        trace=trace,
    )
    return {"nodes": nodes, "plan": plan, "cluster": c, "step_s": step, "events": events(plan, trace, c)}


def events(plan: Any, trace: list, c: Any) -> list[dict[str, Any]]:
    """Timeline events ``{lane, name, start_s, dur_s, bytes, ...}``: the traced compute and
    quantization intervals, and each collective of the plan inside its unit-phase's link interval
    (in issue order, in proportion to its own link time)."""
    from ..projection.spec import Message
    from ..projection.step_schedule import message_transfer

    by_tag: dict[tuple, list] = {}
    for col in plan.collectives:
        by_tag.setdefault((col.unit, str(col.phase), col.micro_batch), []).append(col)
    names = [u.name for u in plan.units]
    out: list[dict[str, Any]] = []
    placed: set[int] = set()
    for iv in trace:
        unit, phase, mb = iv.tag
        what = f"{phase} {names[unit]}" if unit >= 0 else str(phase)
        if iv.lane != "link":
            lane = "quantization" if iv.lane == "quantization" else "compute"
            out.append(
                dict(
                    lane=lane,
                    name=what,
                    start_s=iv.start_s,
                    dur_s=iv.end_s - iv.start_s,
                    bytes=0,
                    unit=unit,
                    micro_batch=mb,
                )
            )
            continue
        cols = [x for x in by_tag.get(iv.tag, []) if id(x) not in placed]
        times = [message_transfer(Message(x.kind, x.algo, x.nodes, x.ranks, x.peer_bytes, 1), c).link_s for x in cols]
        scale = (iv.end_s - iv.start_s) / (sum(times) or 1.0)
        t = iv.start_s
        for x, dt in zip(cols, times):
            placed.add(id(x))
            out.append(_comm_event(x, names, t, dt * scale))
            t += dt * scale
    for x in plan.collectives:  # no link time (one rank per group): at the step's start, zero length
        if id(x) not in placed:
            out.append(_comm_event(x, names, 0.0, 0.0))
    return out


def _comm_event(x: Any, names: list[str], start: float, dur: float) -> dict[str, Any]:
    return dict(
        lane="cross link" if x.nodes > 1 else "intra link",
        name=f"{x.kind}[{x.bucket}]",
        kind=str(x.kind),
        start_s=start,
        dur_s=dur,
        bytes=sum(x.link_bytes().values()) if x.counted else 0,
        unit=x.unit,
        unit_name=names[x.unit] if x.unit >= 0 else "",
        micro_batch=x.micro_batch,
        bits=x.bits,
        group=str(x.group),
    )


PLOT_TAG = "zeropp experiments.plan"
"""The ``Software`` text of every PNG the plan writes and the ``generator`` of its traces: its own
earlier outputs may be replaced."""


def chrome_trace(projections: list[dict[str, Any]]) -> dict[str, Any]:
    """The timelines in Chrome's ``traceEvents`` format: pid = node count's row, tid = lane, µs."""
    evs: list[dict[str, Any]] = []
    for pid, p in enumerate(projections):
        evs.append(dict(ph="M", name="process_name", pid=pid, tid=0, args=dict(name=f"{p['nodes']} nodes")))
        for tid, lane in enumerate(LANES):
            evs.append(dict(ph="M", name="thread_name", pid=pid, tid=tid, args=dict(name=lane)))
        for e in p["events"]:
            args = {k: v for k, v in e.items() if k not in ("lane", "name", "start_s", "dur_s")}
            evs.append(
                dict(
                    ph="X",
                    name=e["name"],
                    cat=e.get("kind", "compute"),
                    pid=pid,
                    tid=LANES.index(e["lane"]),
                    ts=e["start_s"] * 1e6,
                    dur=e["dur_s"] * 1e6,
                    args=args,
                )
            )
    return {"traceEvents": evs, "displayTimeUnit": "ms", "otherData": {"generator": PLOT_TAG}}


def is_plan_trace(doc: object) -> bool:
    """``doc`` (parsed JSON) is a trace the plan wrote: Chrome's format with the plan's generator in
    its ``otherData`` (a profiler trace of the user's saved under the same name is not)."""
    other = doc.get("otherData") if isinstance(doc, dict) else None
    return (
        isinstance(doc, dict)
        and "traceEvents" in doc
        and isinstance(other, dict)
        and other.get("generator") == PLOT_TAG
    )


def draw_lanes(ax: Any, p: dict[str, Any], colour: dict[str, str]) -> None:
    """Draw projection ``p``'s events on ``ax``: one lane per :data:`LANES` entry, time in ms over
    the projected step, each bar coloured by its kind (``colour``)."""
    for e in p["events"]:
        if e["dur_s"] > 0:
            y = len(LANES) - 1 - LANES.index(e["lane"])
            ax.broken_barh(
                [(e["start_s"] * 1e3, e["dur_s"] * 1e3)],
                (y - 0.4, 0.8),
                color=colour[e.get("kind", "compute")],
                linewidth=0,
            )
    ax.set_yticks(range(len(LANES)), list(reversed(LANES)))
    ax.set_xlim(0, p["step_s"] * 1e3)


def plan_outputs(names: tuple[str, str]) -> dict[str, Callable[[Path], bool]]:
    """The ``ours`` tests (zeropp.output_files) of a plan's PNG and trace, named ``names``: a PNG
    carrying :data:`PLOT_TAG`, a trace of the plan's (:func:`is_plan_trace`)."""
    png, trace = names
    return {png: lambda p: holds_tag(p, PLOT_TAG), trace: lambda p: json_file_is(p, is_plan_trace)}


def plot(projections: list[dict[str, Any]], path: Path) -> None:
    """One row per node count, one lane per resource, each interval coloured by kind (legend
    outside), written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = sorted({e.get("kind", "compute") for p in projections for e in p["events"]})
    colour = {k: f"C{i % 10}" for i, k in enumerate(kinds)}
    fig, axes = plt.subplots(len(projections), 1, figsize=(12, 1.6 + 1.4 * len(projections)), squeeze=False)
    for ax, p in zip(axes[:, 0], projections):
        draw_lanes(ax, p, colour)
        ax.set_title(
            f"{p['nodes']} nodes x {p['cluster'].ranks_per_node} ranks: {p['step_s'] * 1e3:.1f} ms", fontsize=9
        )
        ax.set_xlabel("time in the step (ms)")
    handles = [matplotlib.patches.Patch(color=colour[k], label=k) for k in kinds]
    fig.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.tight_layout()
    png = tagged_png(fig, PLOT_TAG, dpi=110, bbox_inches="tight")
    plt.close(fig)
    write_output_file(path, png)
