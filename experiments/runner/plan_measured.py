"""``python -m experiments.plan <run dir> [--step N] [--rank R] [--out DIR]``: a profiled step beside its plan.

Why: the plan (``zeropp.runtime.plan``) and the time model say where a step's time should go; a run
with ``train.profile=true`` recorded where it went (``experiments.runner.profiling``). This reads the
run's config (``summary.json``) and one rank's trace of one step (default: rank 0, its last
profiled step), projects that config's step as ``python -m experiments.plan`` does (same
``--tflops`` / ``--gbps``), and writes, in ``--out`` (default ``<run dir>/profile``):

* ``step_vs_plan.png``: top, the projected step (lanes compute, quantization, intra link, cross
  link); below, the measured step (each on its own axis, ms from the step's start: a CPU run and
  a modelled GPU cluster differ by orders of magnitude), lanes
  ``issue`` (a collective's call on the training thread), ``wait`` (the engine blocked on a unit's
  collective), ``comm worker`` (work off the training thread: qgZ's cross hop on CPU) and
  ``quantization`` (quantize / dequantize parts); each range coloured by kind;
* ``step_vs_plan.json``: both as one Chrome trace (process 0 projected, process 1 measured);

and prints the table ``kind | calls | projected ms | measured ms``: per kind, the plan's calls, the
projected link time of its collectives, and the wall time the rank spent inside its ranges (the
union of calls, parts, waits and hops: nested or concurrent ranges count once), then the whole
step. The two columns measure different things -- modelled link time on the configured cluster
against this host's time in the ranges -- so read them side by side, not as a ratio. The plan is
the steady state; a profiled first step (hpZ builds its secondary copies) sends more than it says.
Bad inputs exit 2 with ``error: ...``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from zeropp.output_files import OutputFileError, check_output_files, path_text_arg, tagged_png, write_output_file

from ..projection.flags import compute_rate, link_rate
from .config import ConfigError
from .profiling import PROFILE_DIR, Span, busy_s, read_step, trace_path

OUTPUTS = ("step_vs_plan.png", "step_vs_plan.json")
"""What the side-by-side writes into ``--out``: a file of these names it did not write is refused first."""

MEASURED_LANES = ("issue", "wait", "comm worker", "quantization")
"""Lanes of the measured step, top to bottom."""


def _args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m experiments.plan <run dir>", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="a run directory of python -m experiments.run with train.profile=true")
    ap.add_argument("--step", type=int, default=None, help="the profiled step (default: the last one)")
    ap.add_argument("--rank", type=int, default=0, help="whose trace (default 0)")
    ap.add_argument(
        "--out",
        type=path_text_arg,
        default=None,
        help="directory for step_vs_plan.png / .json (default <run dir>/profile)",
    )
    ap.add_argument("--tflops", type=compute_rate, default=50.0, help="achieved compute TFLOP/s per rank")
    ap.add_argument("--gbps", type=link_rate, default=100.0, help="cross-node NIC rate, Gbit/s (cluster=local)")
    return ap.parse_args(argv)


def find_trace(run_dir: Path, rank: int, step: int | None) -> Path:
    """Rank ``rank``'s trace of ``step`` (None: its last profiled step); ConfigError naming what exists."""
    if step is not None:
        path = trace_path(run_dir, rank, step)
        if path.is_file():
            return path
    found = sorted(
        (run_dir / PROFILE_DIR).glob(f"rank{rank}_step*.json"),
        key=lambda p: int(p.stem.rpartition("step")[2]) if p.stem.rpartition("step")[2].isdigit() else -1,
    )
    if step is None and found:
        return found[-1]
    have = ", ".join(p.name for p in found) or "none"
    raise ConfigError(
        f"no trace of rank {rank}{'' if step is None else f', step {step}'} in {run_dir / PROFILE_DIR} "
        f"(traces there: {have}); run with train.profile=true train.profile_steps=[N], or pick --step / "
        f"--rank among those"
    )


def load_run(run_dir: Path) -> Any:
    """The run's validated config, from its ``summary.json``."""
    from .config import from_dict
    from .plan_draw import check_plannable

    path = run_dir / "summary.json"
    if not run_dir.is_dir():
        raise ConfigError(
            f"{run_dir} is not a directory; give the run directory of python -m experiments.run "
            f"(or overrides key=value for a plan without a run)"
        )
    try:
        rc = from_dict(json.loads(path.read_text())["config"])
    except FileNotFoundError:
        runs = sorted(q.parent.name for q in run_dir.glob("*/summary.json"))
        if runs:  # a multirun directory: its jobs are the runs
            raise ConfigError(
                f"{run_dir} is a sweep's directory, not a run's; give one of its runs: "
                + ", ".join(str(run_dir / r) for r in runs[:4])
                + (", ..." if len(runs) > 4 else "")
            ) from None
        raise ConfigError(
            f"no summary.json in {run_dir}: the run did not finish; profile a run that completes"
        ) from None
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path} holds no readable run config ({type(e).__name__}: {e})") from None
    check_plannable(rc)
    return rc


def lane_of(s: Span) -> str:
    """The measured lane a range is drawn on."""
    if s.parsed.part in ("quantize", "dequantize"):
        return "quantization"
    if s.parsed.part == "wait":
        return "wait"
    return "issue" if s.main else "comm worker"


def table(p: dict[str, Any], spans: list[Span], step_s: float) -> str:
    """``kind | calls | projected ms | measured ms`` per kind, then the step (module doc)."""
    proj: dict[str, float] = {}
    calls: dict[str, int] = {}
    for e in p["events"]:
        if "kind" in e:
            proj[e["kind"]] = proj.get(e["kind"], 0.0) + e["dur_s"]
    for c in p["plan"].collectives:
        calls[str(c.kind)] = calls.get(str(c.kind), 0) + 1
    kinds = sorted(set(proj) | {s.parsed.kind for s in spans})
    head = f"{'kind':<24} {'calls':>6} {'projected ms':>13} {'measured ms':>12}"
    lines = [head, "-" * len(head)]
    for k in kinds:
        meas = busy_s([s for s in spans if s.parsed.kind == k], lambda s: True)
        lines.append(f"{k:<24} {calls.get(k, 0):>6d} {proj.get(k, 0.0) * 1e3:>13.3f} {meas * 1e3:>12.3f}")
    lines.append(f"{'step':<24} {'':>6} {p['step_s'] * 1e3:>13.3f} {step_s * 1e3:>12.3f}")
    return "\n".join(lines)


def chrome_trace(p: dict[str, Any], spans: list[Span], step: int, rank: int) -> dict[str, Any]:
    """Projected (pid 0, ``experiments.runner.plan``'s lanes) and measured (pid 1) as one Chrome trace, µs."""
    from .plan_draw import chrome_trace as projected

    evs = projected([p])["traceEvents"]
    evs[0]["args"]["name"] = f"projected ({p['nodes']} nodes)"
    evs.append(dict(ph="M", name="process_name", pid=1, tid=0, args=dict(name=f"measured: rank {rank}, step {step}")))
    for tid, lane in enumerate(MEASURED_LANES):
        evs.append(dict(ph="M", name="thread_name", pid=1, tid=tid, args=dict(name=lane)))
    for s in spans:
        evs.append(
            dict(
                ph="X",
                name=s.name,
                cat=s.parsed.kind,
                pid=1,
                tid=MEASURED_LANES.index(lane_of(s)),
                ts=s.start_s * 1e6,
                dur=s.dur_s * 1e6,
            )
        )
    from .plan_draw import PLOT_TAG

    return {"traceEvents": evs, "displayTimeUnit": "ms", "otherData": {"generator": PLOT_TAG}}


def plot(p: dict[str, Any], spans: list[Span], step_s: float, step: int, rank: int, path: Path) -> None:
    """The projected lanes above the measured ones, one time axis, colours by kind (legend outside)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .plan_draw import PLOT_TAG, draw_lanes

    kinds = sorted({e.get("kind", "compute") for e in p["events"]} | {s.parsed.kind for s in spans})
    colour = {k: f"C{i % 10}" for i, k in enumerate(kinds)}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 6))
    draw_lanes(top, p, colour)
    top.set_xlabel("time in the step (ms)")
    top.set_title(
        f"projected: {p['nodes']} nodes x {p['cluster'].ranks_per_node} ranks, {p['step_s'] * 1e3:.1f} ms", fontsize=9
    )
    for s in spans:
        y = len(MEASURED_LANES) - 1 - MEASURED_LANES.index(lane_of(s))
        bottom.broken_barh(
            [(s.start_s * 1e3, max(s.dur_s * 1e3, 1e-3))], (y - 0.4, 0.8), color=colour[s.parsed.kind], linewidth=0
        )
    bottom.set_yticks(range(len(MEASURED_LANES)), list(reversed(MEASURED_LANES)))
    bottom.set_title(f"measured: rank {rank}, step {step}, {step_s * 1e3:.1f} ms", fontsize=9)
    bottom.set_xlabel("time in the step (ms)")
    bottom.set_xlim(0, step_s * 1e3)
    handles = [matplotlib.patches.Patch(color=colour[k], label=k) for k in kinds]
    fig.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.tight_layout()
    png = tagged_png(fig, PLOT_TAG, dpi=110, bbox_inches="tight")
    plt.close(fig)
    write_output_file(path, png)


def main(argv: list[str]) -> int:
    """Print the table, write the PNG and the trace; 2 with ``error: ...`` on a bad input."""
    from .plan_draw import model_units, plan_outputs, project
    from .preflight import check_writable_dir

    try:
        a = _args(argv)
        run_dir = Path(a.run_dir)
        rc = load_run(run_dir)
        out = Path(a.out) if a.out else run_dir / PROFILE_DIR
        check_writable_dir("--out", out)
        try:
            check_output_files(out, "--out", plan_outputs(OUTPUTS))
        except OutputFileError as e:
            raise ConfigError(str(e)) from None
        trace = find_trace(run_dir, a.rank, a.step)
        try:
            step, step_s, spans = read_step(trace, a.step)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        p = project(rc, model_units(rc), rc.topology.nodes, a)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{run_dir}: rank {a.rank}, step {step} ({trace.name}) beside the plan of its config\n")
    print(table(p, spans, step_s))
    plot(p, spans, step_s, step, a.rank, out / OUTPUTS[0])
    write_output_file(out / OUTPUTS[1], json.dumps(chrome_trace(p, spans, step, a.rank)))
    print(
        f"\nside by side: {out / 'step_vs_plan.png'}\ntrace (Perfetto / chrome://tracing): {out / 'step_vs_plan.json'}"
    )
    return 0
