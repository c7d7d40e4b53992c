"""``python -m experiments.report <multirun dir>``: a sweep as a markdown table and PNG plots.

Reads every ``summary.json`` (and ``metrics.jsonl``) under the directory (a multirun directory,
a run directory, or a parent of several sweeps), in Hydra's job order, and writes next to them
(or to ``--out``): ``report.md`` with one row per run and the per-phase bytes per tier, and the
figures of ``report_plots`` (throughput, communication bytes by link, model state per rank,
memory by phase and tier, loss). Runs are named by what sets them apart from the others, in words
(``ZeRO-1 + CPU offload``, ``ZeRO++ (w8g4, hpZ)``, ``FSDP2``: ``labels.label_runs``); what they
all share is said once, above the table and in each figure's title.

It never overwrites a file it did not write: a ``report.md`` or figure already in the output
directory is replaced only when ``report-manifest.json`` (written beside them) shows an earlier
report wrote it and it is unchanged since; otherwise nothing is written and the command exits 2
naming the files (``report_files``). A run file that cannot be read, or ``--out`` naming a file,
also exits 2 with ``error: ...`` naming it.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any, NoReturn

from zeropp.input_files import read_json
from zeropp.output_files import path_arg

from ..launch.command import run_command
from ..projection.labels import label_runs
from ..runner.console import human_bytes
from ..runner.metrics import read_metrics
from .report_files import ReportError, check_outputs, write_outputs
from .report_plots import PLOTS

__all__ = [
    "PLOTS",
    "REPORT",
    "ReportError",
    "load_runs",
    "markdown",
    "phase_markdown",
    "phase_rows",
    "plots",
    "run_labels",
    "write_report",
]

REPORT = "report.md"
FAILED_FILE = "failed.json"
"""What the runner writes into a sweep job's directory when the job fails (``runner.run``)."""
SUMMARY_USED = (
    "label",
    "tokens_per_s",
    "step_time_s",
    "model_tflops",
    "comm_bytes_per_step",
    "comm_wait_s_per_step",
    "memory_max_rank_bytes",
    "memory_per_rank",
    "loss",
)
"""Keys of ``summary.json`` the table and figures read: a summary without one is refused by name."""

PHASE_COLUMNS = ("params", "grads", "optimizer", "activations", "buffers")
"""Device categories of the per-phase table, in column order."""


def _job_key(p: Path) -> tuple:
    """By path, a multirun's jobs (``<sweep>/<n>/``) in Hydra's job order at their sweep's place."""
    name = p.parent.name
    return (str(p.parent.parent), int(name)) if name.isdigit() else (str(p.parent), -1)


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; :class:`ReportError` naming the file when it is unreadable, not
    JSON or not an object (only parsed, so nothing in it can run code)."""
    try:
        doc = read_json(path)
    except (OSError, ValueError) as e:  # ValueError: bad JSON or bad UTF-8
        raise ReportError(f"cannot read {path}: {e}; fix or remove the file") from None
    if not isinstance(doc, dict):
        raise ReportError(f"{path} holds a JSON {type(doc).__name__}, not an object; fix or remove the file")
    return doc


def load_runs(root: Path) -> list[dict[str, Any]]:
    """Summaries under ``root`` (a multirun dir, a run dir, or a parent of several), each with its
    directory (``_dir``) and ``metrics.jsonl`` lines (``_metrics``); :class:`ReportError` names a
    file that cannot be read."""
    paths = sorted(Path(root).rglob("summary.json"), key=_job_key)
    runs = []
    for p in paths:
        s = _read_json(p)
        s["_dir"] = str(p.parent)
        try:
            s["_metrics"] = read_metrics(p.parent / "metrics.jsonl")
        except (OSError, ValueError) as e:
            raise ReportError(f"cannot read {p.parent / 'metrics.jsonl'}: {e}; fix or remove the file") from None
        runs.append(s)
    return runs


def _failed_jobs(root: Path) -> list[dict[str, Any]]:
    """``failed.json`` of the sweep's failed jobs (overrides and error), in job order."""
    jobs = []
    for p in sorted(Path(root).rglob(FAILED_FILE), key=_job_key):
        j = _read_json(p)
        overrides = j.get("overrides")
        if not (isinstance(overrides, list) and all(isinstance(o, str) for o in overrides)) or not isinstance(
            j.get("error"), str
        ):
            raise ReportError(f'{p} has no "overrides" list and "error" text; fix or remove the file')
        jobs.append(j | {"_dir": str(p.parent)})
    return jobs


def _incomplete_jobs(root: Path) -> list[dict[str, Any]]:
    """Jobs that started (their launch wrote ``ranks/spec.json``) but left neither a summary nor
    ``failed.json``: interrupted (Ctrl-C, SIGTERM, the runner killed) or still running. Each is
    its directory (``run_dir``) and ``overrides``, in job order; a spec that cannot be read gives
    no overrides (the job is still counted)."""
    jobs: list[dict[str, Any]] = []
    for p in sorted(Path(root).rglob("ranks/spec.json"), key=lambda q: _job_key(q.parent)):
        d = p.parent.parent
        if (d / "summary.json").exists() or (d / FAILED_FILE).exists():
            continue
        try:
            overrides = _read_json(p).get("overrides")
        except ReportError:
            overrides = None
        ok = isinstance(overrides, list) and all(isinstance(o, str) for o in overrides)
        jobs.append({"run_dir": str(d), "overrides": overrides if ok else []})
    return jobs


def run_labels(runs: list[dict[str, Any]]) -> list[str]:
    """Each run's label: what sets it apart from the other runs, in words (``labels.label_runs``)."""
    return list(label_runs(runs).labels)


def _num(value: Any, spec: str, scale: float = 1.0) -> str:
    """``value`` (times ``scale``) formatted by ``spec``, or ``-`` where the run has none (a run that
    diverged has no final loss; one that stopped before a measured step, no rates)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return "-"
    return format(scale * value, spec)


def _last_step(s: dict[str, Any]) -> Any:
    """The training step a run that did not complete stopped at: its divergence record's step, else
    its last step (``steps`` counts only the steps this launch ran: a resumed run starts at
    ``first_step``); ``?`` when the summary says neither."""
    step = (s.get("divergence") or {}).get("step") if isinstance(s.get("divergence"), dict) else None
    if isinstance(step, int):
        return step
    steps, first = s.get("steps"), s.get("first_step", 1)
    return first + steps - 1 if isinstance(steps, int) and isinstance(first, int) else "?"


def markdown(runs: list[dict[str, Any]]) -> str:
    head = (
        "| run | config | tokens/s | step (ms) | TFLOP/s | comm/step intra | comm/step cross | "
        "comm wait (ms) | model state/rank (max) | loss final | eval loss |"
    )
    lines = [head, "|" + "|".join(["---"] * 11) + "|"]
    for s, name in zip(runs, run_labels(runs)):
        c = s["comm_bytes_per_step"]["by_link"]
        status = s.get("status", "completed")
        config = s["label"] if status == "completed" else f"{s['label']} ({status} at step {_last_step(s)})"
        lines.append(
            f"| {name} | {config} | {_num(s['tokens_per_s'], ',.0f')} | "
            f"{_num((s.get('step_time_s') or {}).get('mean'), '.1f', 1e3)} | "
            f"{_num(s['model_tflops'], '.4f')} | {human_bytes(c['intra'])} | {human_bytes(c['cross'])} | "
            f"{_num(s['comm_wait_s_per_step'], '.1f', 1e3)} | {human_bytes(s['memory_max_rank_bytes'])} | "
            f"{_num(s['loss']['final'], '.3f')} | {_num(s['loss'].get('eval'), '.3f')} |"
        )
    return "\n".join(lines)


def phase_rows(s: dict[str, Any]) -> list[tuple[str, int, dict[str, Any]]]:
    """``(phase, rank, snapshot)`` per phase of a run: the rank with the most device bytes."""
    ranks = [ph for ph in s.get("memory_by_phase") or [] if ph]
    out = []
    for phase in ranks[0] if ranks else []:
        r, snap = max(
            ((r, ph[phase]) for r, ph in enumerate(ranks) if phase in ph), key=lambda x: x[1]["tier_totals"]["device"]
        )
        out.append((phase, r, snap))
    return out


def phase_markdown(runs: list[dict[str, Any]]) -> str:
    lines = [
        "| run | phase | rank | device | params | grads | optimizer | activations | buffers | host | disk | peak |",
        "|" + "|".join(["---"] * 12) + "|",
    ]
    for s, name in zip(runs, run_labels(runs)):
        for phase, r, p in phase_rows(s):
            d, tt = p["tiers"]["device"], p["tier_totals"]
            lines.append(
                f"| {name} | {phase.replace('_', ' ')} | {r} | {human_bytes(tt['device'])} | "
                + " | ".join(human_bytes(d.get(c, 0)) for c in PHASE_COLUMNS)
                + f" | {human_bytes(tt['host'])} | {human_bytes(tt['disk'])} | {human_bytes(p['peak'])} |"
            )
    return "\n".join(lines)


def plots(runs: list[dict[str, Any]]) -> dict[str, bytes]:
    """:data:`PLOTS` as PNG bytes by file name (``report_plots``), runs named by :func:`run_labels`."""
    from .report_plots import render_all

    names = label_runs(runs)
    return render_all(runs, names.labels, names.common, phase_rows)


def _relative(path: str, root: Path) -> str:
    p, r = Path(path).resolve(), Path(root).resolve()
    return str(p.relative_to(r)) if p.is_relative_to(r) and p != r else str(p.name or p)


def write_report(root: Path, out: Path | None = None) -> Path:
    """Write report.md and the plots into ``out`` (default ``root``); returns the report path.
    :class:`ReportError` (nothing written) for a run file that cannot be read or a file in the way
    that an earlier report did not write (``report_files``)."""
    if out is None and not Path(root).is_dir():
        raise ReportError(f"{root} is not a directory; point at a run or multirun directory")
    out = Path(out or root)
    check_outputs(out, (REPORT, *PLOTS))  # before the drawing: a refusal costs nothing
    runs = load_runs(root)
    failed = _failed_jobs(root)
    incomplete = _incomplete_jobs(root)
    if not runs:
        jobs = (f"{len(failed)} failed" if failed else "") + (
            f"{', ' if failed else ''}{len(incomplete)} interrupted or still running" if incomplete else ""
        )
        raise ReportError(
            f"no summary.json under {root}"
            + (f": its jobs did not finish ({jobs}; see their failed.json and ranks/ logs)" if jobs else "")
            + "; point at a run or multirun directory"
        )
    for s in runs:
        missing = [k for k in SUMMARY_USED if k not in s]
        if missing:
            raise ReportError(
                f"{Path(s['_dir']) / 'summary.json'} has no {', '.join(missing)}; it is not a run's summary: fix or remove it"
            )
    figures = plots(runs)
    common = label_runs(runs).common
    absent = [j for j in failed if not (Path(j["_dir"]) / "summary.json").exists()]  # a diverged run has a row
    md = [
        f"# Sweep report: {Path(root).resolve().name}",
        "",
        f"{len(runs)} run{'' if len(runs) == 1 else 's'}"
        + (f", {len(absent)} failed (not in the table or plots)" if absent else "")
        + (
            f", {len(incomplete)} interrupted or still running (no summary: not in the table or plots)"
            if incomplete
            else ""
        )
        + "."
        + (f" All runs: {common}." if common else ""),
        "",
        markdown(runs),
        "",
    ]
    if any(phase_rows(s) for s in runs):
        md += [
            "Memory by phase (per run and phase, the rank with the most device bytes; peak: CUDA allocator on "
            "GPUs, the runtime's accounted device bytes on CPU ranks):",
            "",
            phase_markdown(runs),
            "",
        ]
    md += (
        ["Runs: directory and the overrides that made each:", ""]
        + [
            f"- {name}: `{_relative(s['_dir'], root)}`, `{' '.join(s.get('overrides') or []) or '(defaults)'}`"
            for s, name in zip(runs, run_labels(runs))
        ]
        + [""]
    )
    if failed:
        md += (
            ["Failed jobs:", ""]
            + [f"- `{' '.join(j['overrides'])}`: {(j['error'].splitlines() or [''])[0]}" for j in failed]
            + [""]
        )
    if incomplete:
        md += (
            ["Interrupted or still running (started, but no summary.json and no failed.json):", ""]
            + [f"- `{_relative(j['run_dir'], root)}`, `{' '.join(j['overrides']) or '(defaults)'}`" for j in incomplete]
            + [""]
        )
    md += [f"![{Path(name).stem}]({name})" for name in figures]
    write_outputs(out, {REPORT: ("\n".join(md) + "\n").encode(), **figures})
    return out / REPORT


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m experiments.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("root", type=path_arg, help="a multirun directory (or any directory containing summary.json files)")
    ap.add_argument("--out", type=path_arg, default=None, help="output directory (default: the root)")
    a = ap.parse_args(argv)
    try:
        path = write_report(a.root, a.out)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(path.read_text())
    print(f"report: {path}")


def cli() -> NoReturn:
    """The command: :func:`main`, ended by ``launch.command.run_command`` (Ctrl-C or a failed world
    is one ``error:`` line and the shell's exit status, never a traceback)."""
    run_command(main)


if __name__ == "__main__":
    cli()
