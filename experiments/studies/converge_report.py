"""The convergence suite's outputs: per-scheme statistics across seeds and their three views.

:func:`aggregate` pairs each scheme's seeds with fp's (the gap rule: ``converge.py``'s
docstring), :func:`markdown` / :data:`CSV_FIELDS` / :func:`plot` render it, and
:func:`write_outputs` writes ``converge.md`` / ``.json`` / ``.csv`` and ``loss.png``.
"""

from __future__ import annotations

import csv
import io
import json
import math
import statistics
from pathlib import Path
from typing import Any, Sequence

from ..runner.checks import ConfigError
from ..runner.metrics import read_metrics
from ..runner.preflight import check_writable_dir
from .converge_suite import BASELINE, RunResult, SuiteConfig, scheme_overrides
from .report_files import ReportError, check_outputs
from .report_files import write_outputs as write_files


def _sd(xs: Sequence[float]) -> float | None:
    return statistics.stdev(xs) if len(xs) >= 2 else None


def _mean(xs: Sequence[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def aggregate(cfg: SuiteConfig, results: Sequence[RunResult]) -> list[dict[str, Any]]:
    """One row per scheme (see the module docstring for the gap and "outside seed spread")."""
    ok = {(r.scheme, r.seed): r.summary for r in results if r.summary is not None}
    fp_eval = {seed: s["loss"]["eval"] for (sc, seed), s in ok.items() if sc == BASELINE}
    fp_mean, fp_sd = _mean(list(fp_eval.values())), _sd(list(fp_eval.values()))
    rows = []
    for scheme in cfg.schemes:
        runs = {seed: ok[(scheme, seed)] for seed in cfg.seeds if (scheme, seed) in ok}
        finals = [s["loss"]["final"] for s in runs.values()]
        evals = [s["loss"]["eval"] for s in runs.values()]
        gaps = {seed: 100.0 * (s["loss"]["eval"] / fp_eval[seed] - 1.0) for seed, s in runs.items() if seed in fp_eval}
        gap, gap_sd = _mean(list(gaps.values())), _sd(list(gaps.values()))
        ev_sd = _sd(evals)
        noise = [
            x
            for x in (
                gap_sd,
                None if fp_sd is None or not fp_mean else 100.0 * fp_sd / fp_mean,
                None if ev_sd is None or not fp_mean else 100.0 * ev_sd / fp_mean,
            )
            if x is not None
        ]
        outside = None if gap is None or len(noise) < 3 else abs(gap) > max(noise)
        rows.append(
            {
                "scheme": scheme,
                "overrides": list(scheme_overrides(scheme)),
                "seeds": sorted(runs),
                "failed_seeds": [r.seed for r in results if r.scheme == scheme and r.error],
                "train_loss_final_mean": _mean(finals),
                "train_loss_final_sd": _sd(finals),
                "eval_loss_mean": _mean(evals),
                "eval_loss_sd": ev_sd,
                "gap_pct_mean": gap,
                "gap_pct_sd": gap_sd,
                "gap_pct_per_seed": gaps,
                "seed_spread_pct": max(noise) if noise else None,
                "outside_seed_spread": False if scheme == BASELINE else outside,
                "tokens_per_s_mean": _mean([s["tokens_per_s"] for s in runs.values()]),
                "eval_loss_per_seed": {seed: s["loss"]["eval"] for seed, s in runs.items()},
                "train_loss_final_per_seed": {seed: s["loss"]["final"] for seed, s in runs.items()},
            }
        )
    return rows


def _pm(m: float | None, sd: float | None, fmt: str, sign: str = "") -> str:
    if m is None:
        return "n/a"
    return f"{m:{sign}{fmt}}" + ("" if sd is None else f" ± {sd:{fmt}}")


def markdown(cfg: SuiteConfig, rows: list[dict[str, Any]], results: Sequence[RunResult]) -> str:
    """The table, with the setting above it and the failed runs below it."""
    first = next((r.summary for r in results if r.summary), None)
    lines = [
        f"Convergence suite: {len(cfg.seeds)} seeds ({', '.join(map(str, cfg.seeds))}), overrides `"
        + " ".join(cfg.overrides)
        + "`"
    ]
    if first is not None:
        lines[0] += (
            f"; {first['steps']} steps x {first['tokens_per_step']:,} tokens = "
            f"{first['steps'] * first['tokens_per_step']:,} tokens per run, model "
            f"{first['model']['name'] or 'custom'} ({first['model']['params']:,} params)"
        )
    lines += [
        "",
        "| scheme | overrides | seeds | final train loss | eval loss | gap to fp (eval) | tokens/s | |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        note = "outside seed spread" if r["outside_seed_spread"] else ""
        gap = "baseline" if r["scheme"] == BASELINE else _pm(r["gap_pct_mean"], r["gap_pct_sd"], ".2f", "+")
        gap += "%" if r["gap_pct_mean"] is not None and r["scheme"] != BASELINE else ""
        tps = "n/a" if r["tokens_per_s_mean"] is None else f"{r['tokens_per_s_mean']:,.0f}"
        failed = f" ({len(r['failed_seeds'])} failed)" if r["failed_seeds"] else ""
        lines.append(
            f"| {r['scheme']} | `{' '.join(r['overrides'])}` | {len(r['seeds'])}{failed} | "
            f"{_pm(r['train_loss_final_mean'], r['train_loss_final_sd'], '.4f')} | "
            f"{_pm(r['eval_loss_mean'], r['eval_loss_sd'], '.4f')} | {gap} | {tps} | {note} |"
        )
    lines += [
        "",
        "Mean ± standard deviation across seeds. Gap: per seed 100 x (eval / fp eval of the same seed - 1), "
        'mean ± sd; "outside seed spread" when |gap| exceeds the sd of the per-seed gaps and the seed sd of '
        "fp's and the scheme's eval loss (in % of fp's mean). Tokens/s: mean over seeds (all runs share the "
        "host, so it is noisy on CPU).",
    ]
    failed_runs = [r for r in results if r.error]
    if failed_runs:
        lines += ["", "Failed runs:", ""] + [
            f"- {r.scheme} seed {r.seed} (`{r.run_dir}`): {r.error.splitlines()[0]}" for r in failed_runs if r.error
        ]
    return "\n".join(lines) + "\n"


CSV_FIELDS = (
    "scheme",
    "overrides",
    "n_seeds",
    "failed_seeds",
    "train_loss_final_mean",
    "train_loss_final_sd",
    "eval_loss_mean",
    "eval_loss_sd",
    "gap_pct_mean",
    "gap_pct_sd",
    "seed_spread_pct",
    "outside_seed_spread",
    "tokens_per_s_mean",
)


def _moving_mean(ys: list[float], w: int) -> list[float]:
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y - (ys[i - w] if i >= w else 0.0)
        out.append(acc / min(i + 1, w))
    return out


def plot(cfg: SuiteConfig, results: Sequence[RunResult]) -> bytes:
    """``loss.png`` (its PNG bytes): train loss (moving mean) and eval loss vs tokens; per scheme
    the mean over seeds, the band from the lowest to the highest seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_e) = plt.subplots(1, 2, figsize=(12, 4.5))
    window = 1
    for i, scheme in enumerate(cfg.schemes):
        runs = [r for r in results if r.scheme == scheme and r.summary is not None]
        if not runs:
            continue
        color = f"C{i}"
        train: list[dict[int, float]] = []
        evals: list[dict[int, float]] = []
        for r in runs:
            m = read_metrics(r.run_dir / "metrics.jsonl")
            steps = [rec["step"] for rec in m]
            window = max(1, len(m) // 40)
            train.append(dict(zip(steps, _moving_mean([rec["loss"] for rec in m], window))))
            ev = {rec["step"]: rec["eval_loss"] for rec in m if rec.get("eval_loss") is not None}
            assert r.summary is not None
            ev[r.summary["first_step"] + r.summary["steps"] - 1] = r.summary["loss"]["eval"]
            evals.append(ev)
        tps = runs[0].summary["tokens_per_step"]  # type: ignore[index]
        for ax, curves in ((ax_t, train), (ax_e, evals)):
            steps = sorted(set.intersection(*(set(c) for c in curves)))
            if not steps:
                continue
            ys = [[c[s] for c in curves] for s in steps]
            x = [s * tps for s in steps]
            ax.plot(
                x,
                [statistics.fmean(y) for y in ys],
                color=color,
                label=f"{scheme} ({len(runs)} seeds)",
                marker="o" if ax is ax_e else None,
                ms=3,
            )
            ax.fill_between(x, [min(y) for y in ys], [max(y) for y in ys], color=color, alpha=0.2, lw=0)
    ax_t.set(xlabel="tokens", ylabel="training loss", title=f"Training loss (moving mean over {window} steps)")
    ax_e.set(xlabel="tokens", ylabel="eval loss", title="Eval loss (held-out text)")
    for ax in (ax_t, ax_e):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Convergence: mean over seeds, band = min..max across seeds", fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def _finite(x: Any) -> Any:
    """``x`` with non-finite floats as None (JSON has no NaN)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


OUTPUTS = ("converge.md", "converge.json", "converge.csv", "loss.png")
"""What the suite writes into ``out=``; a file of these names that it did not write is refused
before the first run (report_files: its own earlier files, listed in the manifest, are replaced)."""


def check_out(cfg: SuiteConfig) -> None:
    """Refuse (ConfigError) before any run an ``out=`` the tables cannot be written into: one that
    cannot be created or written, or that holds a file of :data:`OUTPUTS` the suite did not write."""
    check_writable_dir("out", cfg.out)
    try:
        check_outputs(cfg.out, OUTPUTS, "out=")
    except ReportError as e:
        raise ConfigError(f"invalid config: {e}") from None


def write_outputs(cfg: SuiteConfig, results: Sequence[RunResult], *, with_plot: bool = True) -> dict[str, Path]:
    """Write converge.md/.json/.csv (and loss.png) into ``cfg.out``, each atomically and only over
    the suite's own earlier files (report_files); their paths by kind."""
    rows = aggregate(cfg, results)
    doc = {
        "schemes": list(cfg.schemes),
        "seeds": list(cfg.seeds),
        "overrides": list(cfg.overrides),
        "rows": rows,
        "runs": [{"scheme": r.scheme, "seed": r.seed, "run_dir": str(r.run_dir), "error": r.error} for r in results],
    }
    table = io.StringIO(newline="")
    w = csv.DictWriter(table, fieldnames=CSV_FIELDS)
    w.writeheader()
    for r in rows:
        w.writerow(
            {k: r.get(k) for k in CSV_FIELDS}
            | {
                "overrides": " ".join(r["overrides"]),
                "n_seeds": len(r["seeds"]),
                "failed_seeds": " ".join(map(str, r["failed_seeds"])),
            }
        )
    contents = {
        "converge.md": markdown(cfg, rows, results).encode(),
        "converge.json": (json.dumps(_finite(doc), indent=1, allow_nan=False) + "\n").encode(),
        "converge.csv": table.getvalue().encode(),
    }
    if with_plot and any(r.summary for r in results):
        contents["loss.png"] = plot(cfg, results)
    try:
        written = write_files(cfg.out, contents, "out=")
    except ReportError as e:  # a file appeared there during the suite, or the disk refused
        raise ConfigError(f"invalid config: {e}") from None
    return dict(zip(("md", "json", "csv", "png"), written))
