"""``python -m experiments.report <multirun dir>``: a sweep as a markdown table and PNG plots.

Reads every ``summary.json`` (and ``metrics.jsonl``) under the directory, in Hydra's job order,
and writes next to them (or to ``--out``): ``report.md`` with one row per run, and
``throughput.png`` (tokens/s per configuration), ``comm_bytes.png`` (bytes per step per rank,
stacked intra- vs cross-node), ``memory.png`` (model-state bytes of each rank),
``memory_phases.png`` (per run, one bar per phase -- after model creation, optimizer creation,
forward, backward, step -- for the rank with the most device bytes: the device's bytes stacked by category, host and
disk bytes on top, hatched, and the phase's peak as a black tick) and ``loss.png`` (training loss
curves). ``report.md`` also tabulates the per-phase bytes per tier.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .console import human_bytes
from .metrics import read_metrics

PLOTS = ("throughput.png", "comm_bytes.png", "memory.png", "memory_phases.png", "loss.png")
PHASE_LABELS = {"model_creation": "init", "optimizer_creation": "optim"}
"""Short bar labels of the phases whose first four letters would not say which they are."""
PHASE_COLORS = {"params": "tab:blue", "grads": "tab:orange", "optimizer": "tab:green", "activations": "tab:purple",
                "buffers": "tab:gray"}


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


def phase_rows(s: dict[str, Any]) -> list[tuple[str, int, dict[str, Any]]]:
    """``(phase, rank, snapshot)`` per phase of a run: the rank with the most device bytes."""
    ranks = [ph for ph in s.get("memory_by_phase") or [] if ph]
    out = []
    for phase in ranks[0] if ranks else []:
        r, snap = max(((r, ph[phase]) for r, ph in enumerate(ranks) if phase in ph),
                      key=lambda x: x[1]["tier_totals"]["device"])
        out.append((phase, r, snap))
    return out


def phase_markdown(runs: list[dict[str, Any]]) -> str:
    lines = ["| run | phase | rank | device | params | grads | optimizer | activations | buffers | host | disk | peak |",
             "|" + "|".join(["---"] * 12) + "|"]
    for s in runs:
        for phase, r, p in phase_rows(s):
            d, tt = p["tiers"]["device"], p["tier_totals"]
            lines.append(f"| {run_name(s)} | {phase} | {r} | {human_bytes(tt['device'])} | "
                         + " | ".join(human_bytes(d.get(c, 0)) for c in PHASE_COLORS)
                         + f" | {human_bytes(tt['host'])} | {human_bytes(tt['disk'])} | {human_bytes(p['peak'])} |")
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

    phase_names = list(dict.fromkeys(ph for s in runs for ph, _, _ in phase_rows(s)))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.5 * len(runs) * max(len(phase_names), 1) + 2), 4.5))
    pw = 0.8 / max(len(phase_names), 1)
    labelled: set[str] = set()

    def bar(xpos: float, height: float, bottom: float, key: str, **kw: Any) -> None:
        ax.bar(xpos, height, bottom=bottom, width=pw, label=None if key in labelled else key, **kw)
        labelled.add(key)

    for i, s in enumerate(runs):
        for j, (phase, _r, p) in enumerate(phase_rows(s)):
            xpos = i - 0.4 + pw * (phase_names.index(phase) + 0.5)
            bottom = 0.0
            for c, color in PHASE_COLORS.items():
                v = p["tiers"]["device"].get(c, 0) / 2**20
                if v:
                    bar(xpos, v, bottom, f"device {c}", color=color)
                    bottom += v
            for tier, hatch in (("host", "//"), ("disk", "xx")):
                v = p["tier_totals"][tier] / 2**20
                if v:
                    bar(xpos, v, bottom, tier, color="white", edgecolor="black", hatch=hatch)
                    bottom += v
            ax.plot([xpos - pw / 2, xpos + pw / 2], [p["peak"] / 2**20] * 2, color="black", lw=2,
                    label=None if "peak" in labelled else "peak (device)")
            labelled.add("peak")
            top = max(bottom, p["peak"] / 2**20)
            ax.text(xpos, top, PHASE_LABELS.get(phase, phase[:4]), rotation=90, ha="center",
                    va="bottom", fontsize=6)
    ax.set(ylabel="MiB per rank", title="Memory by phase and tier (busiest rank)")
    ax.margins(y=0.15)
    ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
    if not phase_names:
        ax.text(0.5, 0.5, "no per-phase memory in these summaries", transform=ax.transAxes, ha="center")
    if labelled:
        ax.legend(fontsize=7, ncol=2)
    save(fig, "memory_phases.png")

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
    if any(phase_rows(s) for s in runs):
        md += ["Memory by phase (per run and phase, the rank with the most device bytes; peak: CUDA allocator on "
               "GPUs, the runtime's accounted device bytes on CPU ranks):", "", phase_markdown(runs), ""]
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
