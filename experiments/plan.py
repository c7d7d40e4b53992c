"""``python -m experiments.plan [overrides] [--nodes 4,32,384] [--out DIR]``: see a step's communication.

Why: the communication plan (``zeropp.runtime.plan``) says what one ZeroEngine step sends; this
prints it for a runner config (the same Hydra keys and checks as ``python -m experiments.run``:
``model=``, ``quant=``, ``topology=``, ``zero.*``, ``cluster.inter_gbps=`` with ``cluster=emulated``)
and draws the projected step (``experiments.step_schedule``'s replay of the engine's issue order)
as a timeline, for each node count asked for (``--nodes`` or ``plan.nodes=[4,32,384]``; default the
config's ``topology.nodes``), ranks per node as the config's topology:

* the messages grouped by kind and link, with calls and bytes per rank per step, and totals;
* ``<out>/plan_timeline.png``: one row per node count; lanes compute, quantization, intra- and
  cross-node link; time in ms;
* ``<out>/plan_trace.json``: the same intervals as a Chrome trace (Perfetto opens it): one process
  per node count, one thread per lane, each collective one "X" event named ``<kind>[<bucket>]``
  with its bytes in ``args``.

The model is built on the meta device (shapes only). The time model's inputs not in the runner's
config: ``--tflops`` (achieved compute per rank, default 50) and ``--gbps`` (a cross-node NIC's rate
for ``cluster=local``, default 100; ``cluster=emulated`` uses ``cluster.inter_gbps`` and one shared
uplink per node). Bad inputs exit 2 with ``error: ...`` naming the key.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .config import ConfigError, RunConfig

LANES = ("compute", "quantization", "intra link", "cross link")
"""Timeline lanes, top to bottom (CPU ranks' collective work on the compute resource is drawn on
``compute`` with the collective's name)."""


def _args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(prog="python -m experiments.plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default=None, help="node counts to plan, comma-separated (e.g. 4,32,384)")
    ap.add_argument("--out", default="outputs/plan", help="directory for plan_timeline.png and plan_trace.json")
    ap.add_argument("--tflops", type=float, default=50.0, help="achieved compute TFLOP/s per rank")
    ap.add_argument("--gbps", type=float, default=100.0, help="cross-node NIC rate, Gbit/s (cluster=local)")
    a, overrides = ap.parse_known_args(argv)
    rest = []
    for o in overrides:
        key, _, value = o.partition("=")
        if key == "plan.nodes":
            a.nodes = value.strip("[]")
        elif key == "plan.out":
            a.out = value
        elif key.startswith("plan."):
            raise ConfigError(f"unknown key {key!r}; the plan's own keys are plan.nodes and plan.out")
        else:
            rest.append(o)
    return a, rest


def _node_counts(text: str | None, default: int) -> list[int]:
    if text is None:
        return [default]
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise ConfigError(f"invalid plan.nodes / --nodes={text!r}; give positive node counts, e.g. 4,32,384")
    return counts


def load_config(overrides: list[str]) -> RunConfig:
    """The runner's config for ``overrides``, checked as ``python -m experiments.run`` checks it."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from .overrides import check_overrides
    from .run import validated

    check_overrides(overrides)
    with initialize_config_module("zeropp.conf", version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
    rc = validated(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), list(overrides))
    if rc.trainer.name != "zeropp":
        raise ConfigError(f"invalid config: trainer={rc.trainer.name}; the plan describes ZeroEngine's step, so use "
                          f"trainer=zeropp")
    if rc.topology.tp > 1:
        raise ConfigError(f"invalid config: topology.tp={rc.topology.tp}; the TP-local unit sizes need the split "
                          f"model, which this command does not build; plan with topology.tp=1")
    return rc


def model_units(rc: RunConfig) -> tuple:
    """The runner's model's units, from a model built on the meta device."""
    import torch

    from zeropp.runtime.plan import plan_units

    from .trainers import build_model

    with torch.device("meta"):
        model = build_model(rc, torch.device("meta"))
    units = plan_units(model)
    if any(u.frozen for u in units) or not all(u.numel for u in units):
        raise ConfigError("invalid config: the model has frozen parameters (model.lora_rank); the step's timeline "
                          "models trainable units only; plan with model.lora_rank=0")
    return units


def project(rc: RunConfig, units: tuple, nodes: int, a: argparse.Namespace) -> dict[str, Any]:
    """The plan and the traced scheduled step of ``rc`` on ``nodes`` nodes."""
    from zeropp.comm import Topology
    from zeropp.runtime.config import validate_against_topology
    from zeropp.runtime.plan import build_plan

    from .scaling import Cluster, Workload, control_time
    from .step_schedule import Interval, scheduled_step_s, unit_costs

    t = rc.topology
    topo = Topology(nodes=nodes, ranks_per_node=t.ranks_per_node, hpz_size=t.hpz_size)
    try:
        validate_against_topology(rc.zero, topo.world_size, nodes, t.ranks_per_node)
    except ValueError as e:
        raise ConfigError(f"invalid config (zero.* against topology.*): {e}") from None
    plan = build_plan(units, rc.zero, topo)
    numels = tuple(u.numel for u in units)
    tokens = rc.train.micro_batch_size * rc.model.seq_len * rc.zero.grad_accum_steps
    emulated = rc.cluster.name == "emulated"
    c = Cluster(nodes=nodes, ranks_per_node=t.ranks_per_node, cross_gbps=rc.cluster.inter_gbps if emulated else a.gbps,
                nics_per_node=1 if emulated else None)
    w = Workload.from_zero(rc.zero, units=numels, compute_s=6.0 * sum(numels) * tokens / (a.tflops * 1e12),
                           tokens_per_rank=tokens)
    trace: list[Interval] = []
    step = scheduled_step_s(unit_costs(w, c), stage=w.stage, micro_batches=w.grad_accum,
                            prefetch=rc.zero.prefetch_depth, control_s=control_time(w, c), trace=trace)
    return {"nodes": nodes, "plan": plan, "cluster": c, "step_s": step, "events": events(plan, trace, c)}


def events(plan: Any, trace: list, c: Any) -> list[dict[str, Any]]:
    """Timeline events ``{lane, name, start_s, dur_s, bytes, ...}``: the traced compute and
    quantization intervals, and each collective of the plan inside its unit-phase's link interval
    (in issue order, in proportion to its own link time)."""
    from .scaling import Message
    from .step_schedule import message_transfer

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
            out.append(dict(lane=lane, name=what, start_s=iv.start_s, dur_s=iv.end_s - iv.start_s, bytes=0,
                            unit=unit, micro_batch=mb))
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
    return dict(lane="cross link" if x.nodes > 1 else "intra link", name=f"{x.kind}[{x.bucket}]", kind=str(x.kind),
                start_s=start, dur_s=dur, bytes=sum(x.link_bytes().values()) if x.counted else 0,
                unit=x.unit, unit_name=names[x.unit] if x.unit >= 0 else "", micro_batch=x.micro_batch,
                bits=x.bits, group=str(x.group))


def table(p: dict[str, Any]) -> str:
    """The messages of one projection grouped by kind and link, with totals."""
    rows: dict[tuple[str, str], list[int]] = {}
    for x in p["plan"].collectives:
        if x.counted:
            for link, b in x.link_bytes().items():
                if b:
                    r = rows.setdefault((str(x.kind), str(link)), [0, 0])
                    r[0] += 1
                    r[1] += b
    c = p["cluster"]
    head = f"{'kind':<24} {'link':<6} {'calls':>7} {'bytes/rank':>14}"
    lines = [f"{p['nodes']} node(s) x {c.ranks_per_node} ranks: projected step {p['step_s'] * 1e3:.2f} ms", head,
             "-" * len(head)]
    for (kind, link), (calls, b) in sorted(rows.items()):
        lines.append(f"{kind:<24} {link:<6} {calls:>7d} {b:>14,d}")
    for link in ("intra", "cross"):
        lines.append(f"{'total':<24} {link:<6} {'':>7} {sum(v[1] for k, v in rows.items() if k[1] == link):>14,d}")
    return "\n".join(lines)


def chrome_trace(projections: list[dict[str, Any]]) -> dict[str, Any]:
    """The timelines in Chrome's ``traceEvents`` format: pid = node count's row, tid = lane, µs."""
    evs: list[dict[str, Any]] = []
    for pid, p in enumerate(projections):
        evs.append(dict(ph="M", name="process_name", pid=pid, tid=0, args=dict(name=f"{p['nodes']} nodes")))
        for tid, lane in enumerate(LANES):
            evs.append(dict(ph="M", name="thread_name", pid=pid, tid=tid, args=dict(name=lane)))
        for e in p["events"]:
            args = {k: v for k, v in e.items() if k not in ("lane", "name", "start_s", "dur_s")}
            evs.append(dict(ph="X", name=e["name"], cat=e.get("kind", "compute"), pid=pid, tid=LANES.index(e["lane"]),
                            ts=e["start_s"] * 1e6, dur=e["dur_s"] * 1e6, args=args))
    return {"traceEvents": evs, "displayTimeUnit": "ms"}


def plot(projections: list[dict[str, Any]], path: Path) -> None:
    """One row per node count, one lane per resource, each interval coloured by kind (legend outside)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = sorted({e.get("kind", "compute") for p in projections for e in p["events"]})
    colour = {k: f"C{i % 10}" for i, k in enumerate(kinds)}
    fig, axes = plt.subplots(len(projections), 1, figsize=(12, 1.6 + 1.4 * len(projections)), squeeze=False)
    for ax, p in zip(axes[:, 0], projections):
        for e in p["events"]:
            if e["dur_s"] > 0:
                y = len(LANES) - 1 - LANES.index(e["lane"])
                ax.broken_barh([(e["start_s"] * 1e3, e["dur_s"] * 1e3)], (y - 0.4, 0.8),
                               color=colour[e.get("kind", "compute")], linewidth=0)
        ax.set_yticks(range(len(LANES)), list(reversed(LANES)))
        ax.set_xlim(0, p["step_s"] * 1e3)
        ax.set_title(f"{p['nodes']} nodes x {p['cluster'].ranks_per_node} ranks: {p['step_s'] * 1e3:.1f} ms", fontsize=9)
        ax.set_xlabel("time in the step (ms)")
    handles = [matplotlib.patches.Patch(color=colour[k], label=k) for k in kinds]
    fig.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Print the plan, write the PNG and the trace; 2 with ``error: ...`` on a bad input."""
    from .preflight import check_writable_dir

    try:
        a, overrides = _args(list(sys.argv[1:] if argv is None else argv))
        rc = load_config(overrides)
        counts = _node_counts(a.nodes, rc.topology.nodes)
        out = Path(a.out)
        check_writable_dir("--out / plan.out", out)
        units = model_units(rc)
        projections = [project(rc, units, n, a) for n in counts]
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for p in projections:
        print(table(p) + "\n")
    out.mkdir(parents=True, exist_ok=True)
    plot(projections, out / "plan_timeline.png")
    (out / "plan_trace.json").write_text(json.dumps(chrome_trace(projections)))
    print(f"timeline: {out / 'plan_timeline.png'}\ntrace (Perfetto / chrome://tracing): {out / 'plan_trace.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
