"""``python -m experiments.plan [overrides] [--nodes 4,32,384] [--out DIR]``: see a step's communication.

(``python -m experiments.plan <run dir>``: a profiled step of that run beside its projection,
``plan_measured.py``. The projection and its drawing are ``plan_draw.py``'s.)

Why: the communication plan (``zeropp.runtime.plan``) says what one ZeroEngine step sends; this
prints it for a runner config (the same Hydra keys and checks as ``python -m experiments.run``:
``model=``, ``quant=``, ``topology=``, ``zero.*``, ``cluster.inter_gbps=`` with ``cluster=emulated``)
and draws the projected step (``experiments.projection.step_schedule``'s replay of the engine's issue order)
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
uplink per node), or all of the links' figures and the quantization rates from a calibrated
cluster file (``--cluster-file FILE`` or ``plan.cluster_file=FILE``, written by ``python -m
experiments.bench_comm --calibrate``). Bad inputs exit 2 with ``error: ...`` naming the key.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, NoReturn

from zeropp.output_files import OutputFileError, check_output_files, path_text_arg, write_output_file

from ..launch.command import run_command
from ..projection.cluster_file import ClusterFileError, read_cluster_file
from ..projection.flags import compute_rate, link_rate
from .config import ConfigError, RunConfig, without_hydra
from .plan_draw import LANES, check_modelled, check_plannable, chrome_trace, model_units, plan_outputs, plot, project

OUTPUTS = ("plan_timeline.png", "plan_trace.json")
"""What the plan writes into ``--out``: a file of these names it did not write is refused before the plan."""

__all__ = ["LANES", "check_plannable", "chrome_trace", "load_config", "main", "model_units", "plot", "project", "table"]


def _args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(prog="python -m experiments.plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default=None, help="node counts to plan, comma-separated (e.g. 4,32,384)")
    ap.add_argument(
        "--out", type=path_text_arg, default="outputs/plan", help="directory for plan_timeline.png and plan_trace.json"
    )
    ap.add_argument("--tflops", type=compute_rate, default=50.0, help="achieved compute TFLOP/s per rank")
    ap.add_argument(
        "--gbps", type=link_rate, default=None, help="cross-node NIC rate, Gbit/s (cluster=local; default 100)"
    )
    ap.add_argument(
        "--cluster-file",
        default=None,
        help="a calibrated cluster file (python -m experiments.bench_comm --calibrate FILE): its latencies, "
        "bandwidths (the inter-node one replaces --gbps) and quantization rates replace the hand-set constants",
    )
    a, overrides = ap.parse_known_args(argv)
    rest = []
    for o in overrides:
        key, _, value = o.partition("=")
        if key == "plan.nodes":
            a.nodes = value.strip("[]")
        elif key == "plan.out":
            if not value.strip():  # Path("") is the current directory
                raise ConfigError("invalid plan.out: an empty path; name the directory (plan.out=outputs/plan)")
            a.out = value
        elif key == "plan.cluster_file":
            a.cluster_file = value
        elif key.startswith("plan."):
            raise ConfigError(
                f"unknown key {key!r}; the plan's own keys are plan.nodes, plan.out and plan.cluster_file"
            )
        else:
            rest.append(o)
    a.gbps_given, a.gbps = a.gbps is not None, 100.0 if a.gbps is None else a.gbps  # given: see _check_link_sources
    try:
        a.calibrated = read_cluster_file(a.cluster_file) if a.cluster_file else None
    except ClusterFileError as e:
        raise ConfigError(f"--cluster-file / plan.cluster_file: {e}") from None
    return a, rest


def _check_link_sources(a: argparse.Namespace, rc: RunConfig, overrides: list[str]) -> None:
    """One source for the cross-node rate: ``--gbps`` (``cluster=local``), ``cluster.inter_gbps``
    (``cluster=emulated``) or the cluster file's inter-node fit, which replaces either. A rate given
    where another one wins would be ignored, so it is refused."""
    cf = a.calibrated
    file_rate = cf.links["inter"].gbps if cf is not None and "inter" in cf.links else None
    if a.gbps_given and rc.cluster.name == "emulated":
        raise ConfigError(
            f"--gbps {a.gbps:g} does nothing with cluster=emulated, whose link is cluster.inter_gbps "
            f"({rc.cluster.inter_gbps:g}): set cluster.inter_gbps={a.gbps:g} instead, or remove --gbps"
        )
    given = [f"--gbps {a.gbps:g}"] if a.gbps_given else []
    given += [o for o in overrides if o.lstrip("+").partition("=")[0] == "cluster.inter_gbps"]
    if file_rate is not None and given:
        raise ConfigError(
            f"{given[0]} does nothing with --cluster-file / plan.cluster_file {a.cluster_file}, whose inter-node "
            f"rate ({file_rate:.4g} Gbit/s) replaces it: remove {given[0].split('=')[0].split()[0]}, or the file"
        )


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
    from hydra.errors import HydraException

    from .overrides import check_overrides, is_sweep_override
    from .run import validated

    check_overrides(overrides)
    several = [o for o in overrides if o in ("-m", "--multirun") or is_sweep_override(o)]
    if several:
        raise ConfigError(
            f"invalid config: {' '.join(several)}: the plan projects one configuration, not a sweep; "
            "give each key one value and run the plan once per configuration"
        )
    try:
        with initialize_config_module("zeropp.conf", version_base="1.3"):
            cfg = compose("config", overrides=list(overrides))
    except HydraException as e:  # an override Hydra cannot parse or apply
        given = getattr(e, "override", None)  # Hydra's parse errors carry the override they failed on
        raise ConfigError(f"invalid config: {f'{given}: ' if given else ''}{str(e).strip().splitlines()[0]}") from None
    rc = validated(without_hydra(cfg), list(overrides))
    check_plannable(rc)
    check_modelled(rc)
    return rc


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
    lines = [
        f"{p['nodes']} node(s) x {c.ranks_per_node} ranks: projected step {p['step_s'] * 1e3:.2f} ms",
        head,
        "-" * len(head),
    ]
    for (kind, link), (calls, b) in sorted(rows.items()):
        lines.append(f"{kind:<24} {link:<6} {calls:>7d} {b:>14,d}")
    for link in ("intra", "cross"):
        lines.append(f"{'total':<24} {link:<6} {'':>7} {sum(v[1] for k, v in rows.items() if k[1] == link):>14,d}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the plan, write the PNG and the trace; 2 with ``error: ...`` on a bad input. Given a
    run directory first, put its profiled step beside the projection (``plan_measured.py``)."""
    from .preflight import check_writable_dir

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and not argv[0].startswith("-") and "=" not in argv[0]:
        from .plan_measured import main as side_by_side

        return side_by_side(argv)
    try:
        a, overrides = _args(argv)
        rc = load_config(overrides)
        _check_link_sources(a, rc, overrides)
        counts = _node_counts(a.nodes, rc.topology.nodes)
        out = Path(a.out)
        check_writable_dir("--out / plan.out", out)
        try:
            check_output_files(out, "--out / plan.out", plan_outputs(OUTPUTS))
        except OutputFileError as e:
            raise ConfigError(str(e)) from None
        units = model_units(rc)
        projections = [project(rc, units, n, a) for n in counts]
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for p in projections:
        print(table(p) + "\n")
    plot(projections, out / OUTPUTS[0])
    write_output_file(out / OUTPUTS[1], json.dumps(chrome_trace(projections)))
    print(f"timeline: {out / 'plan_timeline.png'}\ntrace (Perfetto / chrome://tracing): {out / 'plan_trace.json'}")
    return 0


def cli() -> NoReturn:
    """The command: :func:`main`, ended by ``launch.command.run_command`` (Ctrl-C or a failed world
    is one ``error:`` line and the shell's exit status, never a traceback)."""
    run_command(main)


if __name__ == "__main__":
    cli()
