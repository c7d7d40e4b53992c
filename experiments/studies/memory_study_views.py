"""The memory study's views: its two tables and its figure, from the result dict that
``memory_study.run_study`` returns (and ``memory_study.json`` holds).

:func:`phase_table` (per configuration and phase, the busiest rank's bytes by tier and
category), :func:`check_table` (the model state at the end of backward against ZeRO's formula)
and :func:`figure` / :func:`plot` (runs grouped, phases side by side, tiers stacked).
"""

from __future__ import annotations

from typing import Any

from ..runner.console import human_bytes

SHOWN_TIERS = ("device", "host")
"""Tiers the tables show (nothing here swaps to disk)."""


CATEGORY_COLORS = {
    "params": "tab:blue",
    "grads": "tab:orange",
    "optimizer": "tab:green",
    "activations": "tab:purple",
    "buffers": "tab:gray",
}


def busiest(run: dict[str, Any], phase: str) -> tuple[int, dict[str, Any]]:
    """``(rank, snapshot)`` of the rank with the most device bytes in ``phase``."""
    return max(((r, ph[phase]) for r, ph in enumerate(run["ranks"])), key=lambda rs: rs[1]["tier_totals"]["device"])


def phase_table(result: dict[str, Any]) -> Any:
    """The rich table of every configuration's phases (the busiest rank's bytes)."""
    from rich.table import Table

    t = Table(
        title=f"Memory per rank after each phase: {result['config']['layers']}-layer MLP, "
        f"Ψ = {result['num_params']:,}, {result['config']['precision']}, N = {result['config']['world']} "
        f"ranks (the rank with the most device bytes)"
    )
    for col in ("config", "phase", "params", "grads", "optimizer", "activations", "buffers", "device", "host"):
        t.add_column(col, justify="left" if col in ("config", "phase") else "right")
    for run in result["runs"]:
        for j, phase in enumerate(run["ranks"][0]):
            _, snap = busiest(run, phase)
            dev = snap["tiers"]["device"]
            t.add_row(
                run["label"] if j == 0 else "",
                phase,
                *(human_bytes(dev[c]) for c in CATEGORY_COLORS),
                human_bytes(snap["tier_totals"]["device"]),
                human_bytes(snap["tier_totals"]["host"]),
            )
        t.add_section()
    return t


def check_table(result: dict[str, Any]) -> Any:
    """The rich table of the model state at the end of backward against ZeRO's formula."""
    from rich.table import Table

    from zeropp.runtime.memory import MODEL_STATE, tier_totals

    t = Table(title="Model state (params + grads + optimizer) at the end of backward vs ZeRO's formula, per rank")
    for col in ("config", "units", "device formula", "device", "host formula", "host", "check"):
        t.add_column(col, justify="right" if col in ("units", "device", "host") else "left")
    for run in result["runs"]:
        _, snap = busiest(run, "backward")
        got, want = tier_totals(snap["tiers"], MODEL_STATE), tier_totals(run["predicted"])
        t.add_row(
            run["label"],
            str(run["units"]),
            f"{run['formula']['device']} = {human_bytes(want['device'])}",
            human_bytes(got["device"]),
            f"{run['formula']['host']} = {human_bytes(want['host'])}",
            human_bytes(got["host"]),
            run["check"],
            style=None if run["matches"] else "bold red",
        )
    return t


def plot_png(result: dict[str, Any]) -> bytes:
    """:func:`figure` as PNG bytes (the study writes them once it knows it may: report_files)."""
    import io

    import matplotlib.pyplot as plt

    fig = figure(result)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def figure(result: dict[str, Any]) -> Any:
    """The study's figure (the caller closes it): one panel per configuration (the runs grouped),
    one stacked bar per phase (side by side, the busiest rank): device bytes by category in colour,
    host bytes by category hatched on top, ZeRO's formula (model state, all tiers) as a dashed line.
    The legend, in stacking order, sits under the panels (constrained layout), never over a bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from zeropp.runtime.memory import tier_totals

    runs = result["runs"]
    fig, axes = plt.subplots(
        1, len(runs), figsize=(2.9 * len(runs), 4.4), sharey=True, squeeze=False, layout="constrained"
    )
    handles: dict[str, Any] = {}
    for ax, run in zip(axes[0], runs):
        phases = list(run["ranks"][0])
        for x, phase in enumerate(phases):
            _, snap = busiest(run, phase)
            bottom = 0.0
            for tier, hatch in (("device", None), ("host", "//")):
                for cat, color in CATEGORY_COLORS.items():
                    v = snap["tiers"][tier][cat] / 2**20
                    if v:
                        bars = ax.bar(
                            x,
                            v,
                            bottom=bottom,
                            color=color,
                            hatch=hatch,
                            edgecolor="black" if hatch else color,
                            alpha=0.55 if hatch else 1.0,
                            width=0.7,
                        )
                        handles.setdefault(f"{tier} {cat}", bars)
                        bottom += v
        want = sum(tier_totals(run["predicted"]).values()) / 2**20
        handles.setdefault(
            "ZeRO formula (params + grads + optimizer, all tiers)", ax.axhline(want, color="black", ls="--", lw=1)
        )
        ax.set_xticks(range(len(phases)), [p.replace("_", "\n") for p in phases], fontsize=7)
        ax.set_title(f"{run['label']}\n{'matches the formula' if run['matches'] else run['check']}", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    axes[0][0].set_ylabel("MiB per rank")
    order = [f"{t} {c}" for t in ("device", "host") for c in CATEGORY_COLORS if f"{t} {c}" in handles]
    order += [k for k in handles if k not in order]
    fig.legend(
        [handles[k] for k in order], order, loc="outside lower center", ncol=len(order), fontsize=7, frameon=False
    )
    fig.suptitle(
        f"{result['config']['layers']}-layer MLP, Ψ = {result['num_params']:,}, "
        f"{result['config']['precision']}, {result['config']['world']} ranks: memory per rank after each "
        "phase (the rank with the most device bytes)",
        fontsize=10,
    )
    return fig
