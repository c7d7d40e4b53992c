"""``python -m experiments.report <multirun dir>``: a sweep as a markdown table and PNG plots.

Reads every ``summary.json`` (and ``metrics.jsonl``) under the directory, in Hydra's job order,
and writes next to them (or to ``--out``): ``report.md`` with one row per run, and
``throughput.png`` (tokens/s per configuration), ``comm_bytes.png`` (bytes per step per rank,
stacked intra- vs cross-node), ``memory.png`` (model-state bytes of each rank) and
``loss.png`` (training loss curves).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .console import human_bytes
from .metrics import read_metrics

PLOTS = ("throughput.png", "comm_bytes.png", "memory.png", "loss.png")


def _job_key(p: Path) -> tuple:
    name = p.parent.name
    return (0, int(name)) if name.isdigit() else (1, str(p))


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


def run_name(s: dict[str, Any]) -> str:
    """The overrides that distinguish the run (Hydra's), else its label."""
    ov = [o for o in s.get("overrides", []) if not o.startswith(("hydra.", "logger", "train.steps", "sweep="))]
    return ",".join(ov) if ov else s["label"]


def markdown(runs: list[dict[str, Any]]) -> str:
    head = ("| run | config | tokens/s | step (ms) | TFLOP/s | comm/step intra | comm/step cross | "
            "comm wait (ms) | model state/rank (max) | loss final | eval loss |")
    lines = [head, "|" + "|".join(["---"] * 11) + "|"]
    for s in runs:
        c = s["comm_bytes_per_step"]["by_link"]
        ev = s["loss"].get("eval")
        lines.append(
            f"| {run_name(s)} | {s['label']} | {s['tokens_per_s']:,.0f} | {1e3 * s['step_time_s']['mean']:.1f} | "
            f"{s['model_tflops']:.4f} | {human_bytes(c['intra'])} | {human_bytes(c['cross'])} | "
            f"{1e3 * s['comm_wait_s_per_step']:.1f} | {human_bytes(s['memory_max_rank_bytes'])} | "
            f"{s['loss']['final']:.3f} | {'' if ev is None else f'{ev:.3f}'} |")
    return "\n".join(lines)


def plots(runs: list[dict[str, Any]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [run_name(s) for s in runs]
    x = list(range(len(runs)))
    written = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(out / name)

    width = max(6.0, 1.1 * len(runs))
    fig, ax = plt.subplots(figsize=(width, 4))
    ax.bar(x, [s["tokens_per_s"] for s in runs], color="tab:blue")
    ax.set(ylabel="tokens/s", title="Throughput per configuration")
    ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
    save(fig, "throughput.png")

    fig, ax = plt.subplots(figsize=(width, 4))
    intra = [s["comm_bytes_per_step"]["by_link"]["intra"] / 2**20 for s in runs]
    cross = [s["comm_bytes_per_step"]["by_link"]["cross"] / 2**20 for s in runs]
    ax.bar(x, intra, label="intra-node", color="tab:green")
    ax.bar(x, cross, bottom=intra, label="cross-node", color="tab:red")
    ax.set(ylabel="MiB per step per rank", title="Communication volume")
    ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
    ax.legend()
    save(fig, "comm_bytes.png")

    fig, ax = plt.subplots(figsize=(width, 4))
    world = max(len(s["memory_per_rank"]) for s in runs)
    bw = 0.8 / max(world, 1)
    for r in range(world):
        vals = [s["memory_per_rank"][r].get("total", 0) / 2**20 if r < len(s["memory_per_rank"]) else 0 for s in runs]
        ax.bar([i - 0.4 + bw * (r + 0.5) for i in x], vals, width=bw, label=f"rank {r}")
    ax.set(ylabel="MiB", title="Model-state memory per rank")
    ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
    ax.legend(fontsize=7, ncol=min(world, 4))
    save(fig, "memory.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    for s, n in zip(runs, names):
        m = s["_metrics"]
        if m:
            ax.plot([r["step"] for r in m], [r["loss"] for r in m], label=n)
        else:
            ax.plot(range(1, len(s["loss"]["curve"]) + 1), s["loss"]["curve"], label=n)
    ax.set(xlabel="step", ylabel="training loss", title="Loss")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    save(fig, "loss.png")
    return written


def write_report(root: Path, out: Path | None = None) -> Path:
    """Write report.md and the plots; returns the report path."""
    runs = load_runs(root)
    if not runs:
        raise SystemExit(f"error: no summary.json under {root}; point at a run or multirun directory")
    out = Path(out or root)
    out.mkdir(parents=True, exist_ok=True)
    written = plots(runs, out)
    failed = [json.loads(p.read_text()) for p in sorted(Path(root).rglob("failed.json"), key=_job_key)]
    md = [f"# Sweep report: {Path(root).resolve().name}", "",
          f"{len(runs)} runs" + (f", {len(failed)} failed (not in the table or plots)" if failed else "") + ".", "",
          markdown(runs), ""]
    if failed:
        md += ["Failed jobs:", ""] + [f"- `{' '.join(j['overrides'])}`: {j['error'].splitlines()[0]}" for j in failed] + [""]
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
