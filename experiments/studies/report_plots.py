"""The figures of ``python -m experiments.report``: one question each, runs named by their labels.

- ``throughput.png``: which configuration trains fastest (tokens/s, all ranks together)?
- ``comm_bytes.png``: how many bytes does a rank send per step, and over which link?
- ``memory.png``: how much model state does a rank hold, and of what kind (the rank holding most)?
- ``memory_phases.png``: where does a rank's memory sit during a step? One panel per run (runs
  grouped), one bar per phase (side by side, names spelled out), the tiers stacked (device, host,
  disk) and the device peak as a black tick, for the rank with the most device bytes in that phase.
- ``loss.png``: how does the training loss fall?

Runs are bars on the vertical axis (horizontal bars), so a label of any length reads without
rotation; the figure's title asks the question and the line under it says what every run shares
(:func:`experiments.projection.labels.label_runs`); legends sit outside the axes (matplotlib's constrained
layout, ``loc="outside ..."``) so they never cover data; every axis names its unit, chosen so the
largest value reads in ones to thousands (B, KiB, MiB, GiB).
"""

from __future__ import annotations

import textwrap
from typing import Any, Callable, Sequence

PLOTS = ("throughput.png", "comm_bytes.png", "memory.png", "memory_phases.png", "loss.png")
TIER_STYLE = {
    "device": {"color": "tab:blue"},
    "host": {"color": "tab:orange", "hatch": "//", "edgecolor": "white"},
    "disk": {"color": "tab:gray", "hatch": "xx", "edgecolor": "white"},
}
"""How each memory tier is drawn in ``memory_phases.png``."""
STATE_COLORS = {"params": "tab:blue", "grads": "tab:orange", "optimizer": "tab:green", "hpz_secondary": "tab:purple"}
"""Model-state categories of ``memory.png`` (``summary.json``'s ``memory_per_rank``)."""
STATE_WORDS = {
    "params": "parameters",
    "grads": "gradients",
    "optimizer": "optimizer state",
    "hpz_secondary": "hpZ secondary copy",
}
DPI = 110


def byte_unit(largest: float) -> tuple[float, str]:
    """``(divisor, unit)`` so that ``largest / divisor`` is in [1, 1024) (B for anything below a KiB)."""
    for power, unit in ((3, "GiB"), (2, "MiB"), (1, "KiB")):
        if largest >= 1024**power:
            return float(1024**power), unit
    return 1.0, "B"


def phase_words(phase: str) -> str:
    """``model_creation`` -> ``model\\ncreation``: the phase's name in full, one word a line."""
    return phase.replace("_", "\n")


def _figure(n_rows: int, question: str, common: str) -> tuple[Any, Any]:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 1.3 + 0.42 * max(n_rows, 2)), layout="constrained")
    fig.suptitle(question, fontsize=11, x=0.02, ha="left")
    if common:
        ax.set_title(f"all runs: {common}", fontsize=8, color="0.35", loc="left")
    return fig, ax


def _runs_axis(ax: Any, labels: Sequence[str]) -> list[int]:
    """Runs top to bottom in sweep order on the vertical axis; returns their positions."""
    y = list(range(len(labels)))
    ax.set_yticks(y, list(labels), fontsize=8)
    ax.invert_yaxis()
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    return y


def _annotate(ax: Any, y: Sequence[int], ends: Sequence[float], texts: Sequence[str]) -> None:
    """The value at the end of each bar; the axis grows by a fifth so the text stays inside."""
    for yi, end, t in zip(y, ends, texts):
        ax.text(end, yi, f" {t}", va="center", ha="left", fontsize=7)
    ax.set_xlim(0, max(max(ends, default=0), 1e-12) * 1.2)


def throughput(ax: Any, runs: Sequence[dict[str, Any]], labels: Sequence[str]) -> None:
    y = _runs_axis(ax, labels)
    v = [s["tokens_per_s"] for s in runs]
    ax.barh(y, v, color="tab:blue", height=0.6)
    _annotate(ax, y, v, [f"{x:,.0f}" for x in v])
    ax.set_xlabel("tokens per second (all ranks together)")


def comm_bytes(ax: Any, runs: Sequence[dict[str, Any]], labels: Sequence[str]) -> None:
    y = _runs_axis(ax, labels)
    intra = [s["comm_bytes_per_step"]["by_link"]["intra"] for s in runs]
    cross = [s["comm_bytes_per_step"]["by_link"]["cross"] for s in runs]
    total = [a + b for a, b in zip(intra, cross)]
    div, unit = byte_unit(max(total, default=0))
    ax.barh(y, [a / div for a in intra], color="tab:green", height=0.6, label="intra-node")
    ax.barh(y, [b / div for b in cross], left=[a / div for a in intra], color="tab:red", height=0.6, label="cross-node")
    _annotate(ax, y, [t / div for t in total], [f"{t / div:,.1f}" for t in total])
    ax.set_xlabel(f"{unit} sent per step per rank")
    ax.figure.legend(loc="outside lower center", ncol=2, fontsize=8, frameon=False)


def model_state(ax: Any, runs: Sequence[dict[str, Any]], labels: Sequence[str]) -> None:
    y = _runs_axis(ax, labels)
    busiest = [max(s["memory_per_rank"], key=lambda m: m.get("total", 0)) if s["memory_per_rank"] else {} for s in runs]
    div, unit = byte_unit(max((m.get("total", 0) for m in busiest), default=0))
    left = [0.0] * len(runs)
    for cat, color in STATE_COLORS.items():
        v = [m.get(cat, 0) / div for m in busiest]
        if any(v):
            ax.barh(y, v, left=left, color=color, height=0.6, label=STATE_WORDS[cat])
            left = [a + b for a, b in zip(left, v)]
    _annotate(ax, y, left, [f"{x:,.1f}" for x in left])
    ax.set_xlabel(f"{unit} of model state on the rank holding most (all tiers: device, host, disk)")
    ax.figure.legend(loc="outside lower center", ncol=4, fontsize=8, frameon=False)


def memory_phases(
    runs: Sequence[dict[str, Any]],
    labels: Sequence[str],
    common: str,
    rows: Callable[[dict[str, Any]], list[tuple[str, int, dict[str, Any]]]],
) -> Any:
    """The small multiples of ``memory_phases.png`` (``rows``: report.phase_rows)."""
    import matplotlib.pyplot as plt

    from zeropp.runtime.memory import PHASES

    per_run = [rows(s) for s in runs]
    seen = {ph for r in per_run for ph, _, _ in r}
    phases = [ph for ph in PHASES if ph in seen] + sorted(seen - set(PHASES))  # in the order they happen
    nrows = -(-len(runs) // 4)
    cols = -(-len(runs) // nrows)
    fig, axes = plt.subplots(
        nrows,
        cols,
        figsize=(0.55 * max(len(phases), 2) * cols + 1.2, 2.4 * nrows + 1.2),
        sharey=True,
        sharex=True,
        squeeze=False,
        layout="constrained",
    )
    fig.suptitle(
        "Memory of a rank after each phase of a step, by tier" + (f"\nall runs: {common}" if common else ""),
        fontsize=10,
    )
    largest = max(
        (
            max(p["tier_totals"]["device"] + p["tier_totals"]["host"] + p["tier_totals"]["disk"], p["peak"])
            for r in per_run
            for _, _, p in r
        ),
        default=0,
    )
    div, unit = byte_unit(largest)
    drawn: set[str] = set()  # legend entries given a handle already
    for k, ax in enumerate(axes.flat):
        if k >= len(runs):
            ax.set_visible(False)
            if k >= cols:  # the panel above is the last of its column: it names the phases
                axes.flat[k - cols].xaxis.set_tick_params(labelbottom=True)
            continue
        by_phase = {ph: p for ph, _, p in per_run[k]}
        for x, ph in enumerate(phases):
            p = by_phase.get(ph)
            if p is None:
                ax.text(x, 0, "n/a", ha="center", va="bottom", fontsize=6, color="0.4")
                continue
            bottom = 0.0
            for tier, style in TIER_STYLE.items():
                v = p["tier_totals"][tier] / div
                if v:
                    ax.bar(x, v, bottom=bottom, width=0.7, label=tier if tier not in drawn else None, **style)
                    drawn.add(tier)
                    bottom += v
            ax.plot(
                [x - 0.35, x + 0.35],
                [p["peak"] / div] * 2,
                color="black",
                lw=2,
                label="device peak" if "peak" not in drawn else None,
            )
            drawn.add("peak")
        ax.set_title(textwrap.fill(labels[k], 34), fontsize=8)
        ax.set_xticks(range(len(phases)), [phase_words(p) for p in phases], fontsize=6.5)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
        if k % cols == 0:
            ax.set_ylabel(f"{unit} per rank", fontsize=8)
    if not phases:
        axes.flat[0].text(
            0.5, 0.5, "no per-phase memory in these summaries", transform=axes.flat[0].transAxes, ha="center"
        )
    handles: dict[str, Any] = {}
    for a in axes.flat:
        for h, name in zip(*a.get_legend_handles_labels()):
            handles.setdefault(name, h)
    order = [k for k in (*TIER_STYLE, "device peak") if k in handles]
    if order:  # tiers bottom to top, then the peak
        fig.legend([handles[k] for k in order], order, loc="outside lower center", ncol=4, fontsize=8, frameon=False)
    return fig


def loss(ax: Any, runs: Sequence[dict[str, Any]], labels: Sequence[str]) -> None:
    """One line per run; each run its own marker and dash, so runs whose losses coincide (the
    same arithmetic, e.g. offloading) stay visible under one another."""
    markers, dashes = "osD^vxP*<>", ("-", "--", ":", "-.")
    for i, (s, name) in enumerate(zip(runs, labels)):
        m = s["_metrics"]
        steps, values = (
            ([r["step"] for r in m], [r["loss"] for r in m])
            if m
            else (list(range(1, len(s["loss"]["curve"]) + 1)), s["loss"]["curve"])
        )
        ax.plot(
            steps,
            values,
            label=name,
            lw=1.3,
            ls=dashes[i % len(dashes)],
            marker=markers[i % len(markers)],
            markersize=4,
            markevery=max(1, len(steps) // 12),
            fillstyle="none",
        )
    ax.set(xlabel="step", ylabel="training loss (cross-entropy, nats per token)")
    ax.grid(alpha=0.3)
    ax.figure.legend(loc="outside right upper", fontsize=7, frameon=False)


def figures(
    runs: Sequence[dict[str, Any]],
    labels: Sequence[str],
    common: str,
    rows: Callable[[dict[str, Any]], list[tuple[str, int, dict[str, Any]]]],
) -> dict[str, Any]:
    """Every figure of :data:`PLOTS`, by file name (``rows``: report.phase_rows); the caller closes them."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    figs = {}
    for name, question, draw in (
        ("throughput.png", "Throughput: which configuration trains fastest?", throughput),
        ("comm_bytes.png", "Communication: bytes each rank sends per step, by link", comm_bytes),
        ("memory.png", "Model state per rank: what each configuration keeps", model_state),
    ):
        fig, ax = _figure(len(runs), question, common)
        draw(ax, runs, labels)
        figs[name] = fig
    figs["memory_phases.png"] = memory_phases(runs, labels, common, rows)
    fig, ax = plt.subplots(figsize=(8.5, 4), layout="constrained")
    fig.suptitle("Training loss", fontsize=11, x=0.02, ha="left")
    if common:
        ax.set_title(f"all runs: {common}", fontsize=8, color="0.35", loc="left")
    loss(ax, runs, labels)
    figs["loss.png"] = fig
    return figs


def render_all(
    runs: Sequence[dict[str, Any]],
    labels: Sequence[str],
    common: str,
    rows: Callable[[dict[str, Any]], list[tuple[str, int, dict[str, Any]]]],
) -> dict[str, bytes]:
    """Every figure of :data:`PLOTS` as PNG bytes, by file name (the report writes them, once it
    knows it may: ``report_files.write_outputs``)."""
    import io

    import matplotlib.pyplot as plt

    rendered = {}
    for name, fig in figures(runs, labels, common, rows).items():
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=DPI)
        plt.close(fig)
        rendered[name] = buf.getvalue()
    return rendered
