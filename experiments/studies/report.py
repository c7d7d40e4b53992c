"""``python -m experiments.report <multirun dir>``: a sweep as a markdown table and PNG plots.

Reads every ``summary.json`` (and ``metrics.jsonl``) under the directory (a multirun directory,
a run directory, or a parent of several sweeps), in Hydra's job order, and writes next to them
(or to ``--out``): ``report.md`` with one row per run and the per-phase bytes per tier, and the
figures of ``report_plots`` (throughput, communication bytes by link, model state per rank,
memory by phase and tier, loss). Runs are named by what sets them apart from the others, in words
(``ZeRO-1 + CPU offload``, ``ZeRO++ (w8g4, hpZ)``, ``FSDP2``: ``labels.label_runs``); what they
all share is said once, above the table and in each figure's title.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ..runner.console import human_bytes
from ..runner.metrics import read_metrics
from .labels import label_runs
from .report_plots import PLOTS

__all__ = ["PLOTS", "load_runs", "markdown", "phase_markdown", "phase_rows", "plots", "run_labels", "write_report"]

PHASE_COLUMNS = ("params", "grads", "optimizer", "activations", "buffers")
"""Device categories of the per-phase table, in column order."""


def _job_key(p: Path) -> tuple:
    """By path, a multirun's jobs (``<sweep>/<n>/``) in Hydra's job order at their sweep's place."""
    name = p.parent.name
    return (str(p.parent.parent), int(name)) if name.isdigit() else (str(p.parent), -1)


def load_runs(root: Path) -> list[dict[str, Any]]:
    """Summaries under ``root`` (a multirun dir, a run dir, or a parent of several)."""
    paths = sorted(Path(root).rglob("summary.json"), key=_job_key)
    runs = []
    for p in paths:
        s = json.loads(p.read_text())
        s["_dir"] = str(p.parent)
        s["_metrics"] = read_metrics(p.parent / "metrics.jsonl")
        runs.append(s)
    return runs


def run_labels(runs: list[dict[str, Any]]) -> list[str]:
    """Each run's label: what sets it apart from the other runs, in words (``labels.label_runs``)."""
    return list(label_runs(runs).labels)


def markdown(runs: list[dict[str, Any]]) -> str:
    head = (
        "| run | config | tokens/s | step (ms) | TFLOP/s | comm/step intra | comm/step cross | "
        "comm wait (ms) | model state/rank (max) | loss final | eval loss |"
    )
    lines = [head, "|" + "|".join(["---"] * 11) + "|"]
    for s, name in zip(runs, run_labels(runs)):
        c = s["comm_bytes_per_step"]["by_link"]
        ev = s["loss"].get("eval")
        lines.append(
            f"| {name} | {s['label']} | {s['tokens_per_s']:,.0f} | {1e3 * s['step_time_s']['mean']:.1f} | "
            f"{s['model_tflops']:.4f} | {human_bytes(c['intra'])} | {human_bytes(c['cross'])} | "
            f"{1e3 * s['comm_wait_s_per_step']:.1f} | {human_bytes(s['memory_max_rank_bytes'])} | "
            f"{s['loss']['final']:.3f} | {'' if ev is None else f'{ev:.3f}'} |"
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


def plots(runs: list[dict[str, Any]], out: Path) -> list[Path]:
    """Draw :data:`PLOTS` into ``out`` (``report_plots``), runs named by :func:`run_labels`."""
    from .report_plots import draw_all

    names = label_runs(runs)
    return draw_all(runs, names.labels, names.common, out, phase_rows)


def _relative(path: str, root: Path) -> str:
    p, r = Path(path).resolve(), Path(root).resolve()
    return str(p.relative_to(r)) if p.is_relative_to(r) and p != r else str(p.name or p)


def write_report(root: Path, out: Path | None = None) -> Path:
    """Write report.md and the plots; returns the report path."""
    runs = load_runs(root)
    if not runs:
        raise SystemExit(f"error: no summary.json under {root}; point at a run or multirun directory")
    out = Path(out or root)
    out.mkdir(parents=True, exist_ok=True)
    written = plots(runs, out)
    failed = [json.loads(p.read_text()) for p in sorted(Path(root).rglob("failed.json"), key=_job_key)]
    common = label_runs(runs).common
    md = [
        f"# Sweep report: {Path(root).resolve().name}",
        "",
        f"{len(runs)} runs"
        + (f", {len(failed)} failed (not in the table or plots)" if failed else "")
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
            + [f"- `{' '.join(j['overrides'])}`: {j['error'].splitlines()[0]}" for j in failed]
            + [""]
        )
    md += [f"![{p.stem}]({p.name})" for p in written]
    path = out / "report.md"
    path.write_text("\n".join(md) + "\n")
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m experiments.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("root", type=Path, help="a multirun directory (or any directory containing summary.json files)")
    ap.add_argument("--out", type=Path, default=None, help="output directory (default: the root)")
    a = ap.parse_args(argv)
    path = write_report(a.root, a.out)
    print(path.read_text())
    print(f"report: {path}")


if __name__ == "__main__":
    main()
