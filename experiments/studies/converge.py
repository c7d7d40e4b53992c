"""``python -m experiments.converge``: how much accuracy each communication scheme costs.

Trains the fp baseline and the chosen schemes on real text (``data=text``) for the same token
budget, two or more seeds each, and writes into the output directory:

- ``converge.md`` / ``converge.json`` / ``converge.csv``: per scheme the final training loss and
  the eval loss (mean ± standard deviation across seeds), the gap to fp in % with its spread, and
  tokens/s; failed runs are listed;
- ``loss.png``: training loss (moving mean) and eval loss against tokens, the mean per scheme
  with a band from the lowest to the highest seed;
- ``runs/<scheme>/seed<k>/``: each run's own directory (``summary.json``, ``metrics.jsonl``).

    python -m experiments.converge                                   # the defaults (~20 min, 4 CPU ranks)
    python -m experiments.converge schemes=fp,w4g4 seeds=3           # seeds: a count, or a list 0,1,5
    python -m experiments.converge model=large train.steps=2000 launcher.device=cuda topology=1x4
    python -m experiments.converge out=outputs/conv optim.lr=1e-3    # any runner override

The gap of a scheme is paired by seed (the same seed gives fp and the scheme the same
initialization and data order): ``gap_s = 100 * (eval_s / eval_fp_s - 1)`` per seed, reported as
their mean ± standard deviation. A gap is named "outside seed spread" when its magnitude exceeds
each measure of seed noise: the standard deviation of the per-seed gaps, and the seed standard
deviation of fp's and of the scheme's eval loss (in % of fp's mean eval loss).

Why the runner as a library (:func:`experiments.runner.run.run_job`) rather than subprocesses of
``python -m experiments.run``: every run is composed and validated exactly like the command line,
its summary comes back as a dict (no output to parse), and a failure arrives as a typed exception
(``ConfigError``/``RankFailure``) the suite records before going on. The ranks are still separate
processes (the runner's launcher); this process only composes, waits and tabulates. The whole
configuration is composed once up front, so a bad override is refused before the first run.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

from zeropp.comm.spec import RECIPES

from ..runner.config import ConfigError, RunConfig, from_omegaconf
from ..runner.metrics import read_metrics
from ..runner.overrides import check_overrides

SCHEMES: dict[str, tuple[str, ...]] = {
    "fp": ("quant=none",),
    "zeropp": ("quant=zeropp",),
    "w4g4": ("quant=w4g4",),
    "w4g4_ef": ("quant=w4g4", "zero.grads.error_feedback=true"),
    "w4g4h": ("quant=w4g4h",),
    "sdp4bit": ("quant=sdp4bit",),
}
"""Scheme name -> the runner overrides that select it. Any other ``quant=`` recipe name
(``zeropp.comm.spec.RECIPES``) is accepted as a scheme too, meaning ``quant=<name>``."""

BASELINE = "fp"
"""The scheme every gap is measured against (it must be among the schemes)."""

DEFAULT_SCHEMES: tuple[str, ...] = tuple(SCHEMES)
DEFAULT_SEEDS: tuple[int, ...] = (0, 1)

SUITE_DEFAULTS: tuple[str, ...] = (
    "model=small",
    "topology=2x2",
    "data=text",
    "train.steps=400",
    "train.micro_batch_size=8",
    "train.eval_every=50",
    "train.eval_batches=8",
    "logger=none",
    "launcher.progress=false",
)
"""Runner overrides of the default suite: GPT ``small`` (0.83M params), 4 gloo ranks as 2 nodes
x 2, 400 steps of 4 x 8 x 64 tokens (0.82M tokens per run, ~100 s each on 2 CPU cores). Each
evaluation reads 8 held-out batches per rank (256 sequences, 16K tokens): one batch alone made
fp's eval loss differ by 3.5% between seeds, more than the gaps the suite is to measure. An
override of the same key on the command line replaces one of these."""

SUITE_KEYS = ("schemes", "seeds", "out")
"""The suite's own keys; every other ``key=value`` goes to each run."""

RESERVED = {"quant": "schemes=", "train.seed": "seeds=", "hydra.run.dir": "out=", "resume": "a fresh out="}
"""Runner keys the suite sets itself -> what to pass instead."""

Runner = Callable[[list[str], Path], dict[str, Any]]
"""``(overrides, run_dir) -> summary``: :func:`experiments.runner.run.run_job`'s signature."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SuiteConfig:
    """What the suite runs: every (scheme, seed) pair with the same runner overrides."""

    schemes: tuple[str, ...] = DEFAULT_SCHEMES
    """Scheme names (:data:`SCHEMES` or a ``quant=`` recipe); must include ``fp``."""
    seeds: tuple[int, ...] = DEFAULT_SEEDS
    """``train.seed`` of each run of each scheme; at least two, so there is a spread."""
    out: Path = Path("outputs/converge")
    """Output directory (table, plot, ``runs/``)."""
    overrides: tuple[str, ...] = SUITE_DEFAULTS
    """Runner overrides shared by every run (suite defaults merged with the command line's)."""

    def __post_init__(self) -> None:
        if not self.schemes:
            raise ConfigError("invalid config: schemes is empty; name at least fp and one scheme, e.g. schemes=fp,w4g4")
        dup = sorted({s for s in self.schemes if self.schemes.count(s) > 1})
        if dup:
            raise ConfigError(
                f"invalid config: schemes={','.join(self.schemes)} repeats {', '.join(dup)}; name each once"
            )
        for s in self.schemes:
            scheme_overrides(s)  # unknown name / missing recipe
        if BASELINE not in self.schemes:
            raise ConfigError(
                f"invalid config: schemes={','.join(self.schemes)} lacks {BASELINE}; the gaps are "
                f"measured against it, add it (schemes={BASELINE},{','.join(self.schemes)})"
            )
        if len(self.seeds) < 2:
            raise ConfigError(
                f"invalid config: seeds={','.join(map(str, self.seeds))} gives {len(self.seeds)} seed; "
                "the spread across seeds needs at least 2 (seeds=2, or a list seeds=0,1)"
            )
        if len(set(self.seeds)) != len(self.seeds) or any(s < 0 for s in self.seeds):
            raise ConfigError(f"invalid config: seeds={','.join(map(str, self.seeds))}; give distinct seeds >= 0")
        for o in self.overrides:
            key = _key(o)
            for r, instead in RESERVED.items():
                if key == r or key.startswith(r + "."):
                    raise ConfigError(f"invalid config: {o!r} is set by the suite for each run; use {instead} instead")

    @classmethod
    def from_args(cls, argv: Sequence[str], *, now: str | None = None) -> SuiteConfig:
        """Parse ``key=value`` arguments: the suite's keys (:data:`SUITE_KEYS`), the rest runner
        overrides merged over :data:`SUITE_DEFAULTS` (same key: the command line wins)."""
        kw: dict[str, Any] = {}
        extra: list[str] = []
        for a in argv:
            if "=" not in a or a.startswith("-"):
                raise ConfigError(
                    f"invalid argument {a!r}: the suite takes key=value arguments only "
                    f"(its keys {', '.join(SUITE_KEYS)}, or any runner override); see --help"
                )
            key, value = a.split("=", 1)
            if key == "schemes":
                kw["schemes"] = tuple(s.strip() for s in value.split(",") if s.strip())
            elif key == "seeds":
                kw["seeds"] = _parse_seeds(value)
            elif key == "out":
                kw["out"] = Path(value)
            else:
                extra.append(a)
        if "out" not in kw:
            kw["out"] = Path("outputs/converge") / (now or time.strftime("%Y-%m-%d_%H-%M-%S"))
        return cls(overrides=merge_overrides(SUITE_DEFAULTS, extra), **kw)

    def run_overrides(self, scheme: str, seed: int) -> list[str]:
        """The runner overrides of one run."""
        return [*self.overrides, *scheme_overrides(scheme), f"train.seed={seed}"]


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _parse_seeds(value: str) -> tuple[int, ...]:
    """``3`` -> (0, 1, 2); ``0,1,5`` -> (0, 1, 5)."""
    try:
        parts = [int(p) for p in value.split(",") if p.strip()]
    except ValueError:
        raise ConfigError(
            f"invalid config: seeds={value!r}; give a count (seeds=2) or a list of integers (seeds=0,1,5)"
        ) from None
    if len(parts) == 1 and "," not in value:
        if parts[0] < 2:
            raise ConfigError(
                f"invalid config: seeds={value}; the spread across seeds needs at least 2 "
                "(a count seeds=2, or a list seeds=0,1)"
            )
        return tuple(range(parts[0]))
    return tuple(parts)


def merge_overrides(base: Sequence[str], extra: Sequence[str]) -> tuple[str, ...]:
    """``base`` with each key that ``extra`` sets replaced, then ``extra``'s in its order."""
    keys = {_key(o) for o in extra}
    return (*[o for o in base if _key(o) not in keys], *extra)


def scheme_overrides(name: str) -> tuple[str, ...]:
    """The runner overrides of scheme ``name``; ConfigError naming it when it does not exist
    or its ``quant=`` recipe is missing from this checkout's ``RECIPES``."""
    ov = SCHEMES.get(name) or ((f"quant={name}",) if name in RECIPES else None)
    if ov is None:
        raise ConfigError(
            f"invalid config: unknown scheme {name!r}; schemes: {', '.join(SCHEMES)}, or any quant= "
            f"recipe ({', '.join(sorted(RECIPES))})"
        )
    recipe = next(o.split("=", 1)[1] for o in ov if o.startswith("quant="))
    if recipe not in RECIPES:
        raise ConfigError(
            f"invalid config: scheme {name!r} needs the quant recipe {recipe!r}, which this checkout "
            f"does not have (zeropp.comm.spec.RECIPES: {', '.join(sorted(RECIPES))}); leave it out, "
            f"e.g. schemes={','.join(s for s in SCHEMES if s != name and _recipe_exists(s))}"
        )
    return ov


def _recipe_exists(scheme: str) -> bool:
    return all(o.split("=", 1)[1] in RECIPES for o in SCHEMES[scheme] if o.startswith("quant="))


def compose(overrides: Sequence[str]) -> RunConfig:
    """The validated config of one run, composed as ``run_job`` does, without starting it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from omegaconf import OmegaConf

    from ..runner import schema

    schema.register()
    check_overrides(list(overrides))
    with initialize_config_module("zeropp.conf", version_base="1.3"):
        cfg = hydra_compose("config", overrides=list(overrides))
    return from_omegaconf(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]))


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunResult:
    """One (scheme, seed) run: its summary, or the error that stopped it."""

    scheme: str
    """Scheme name."""
    seed: int
    """``train.seed``."""
    run_dir: Path
    """The run's directory."""
    summary: dict[str, Any] | None = None
    """The run's summary.json (None when it failed)."""
    error: str | None = None
    """Why it failed (None when it finished)."""


def run_suite(
    cfg: SuiteConfig, *, runner: Runner | None = None, on_result: Callable[[list[RunResult]], None] | None = None
) -> list[RunResult]:
    """Run every (seed, scheme) pair, schemes interleaved within a seed so that a drift of the
    host's load touches all schemes alike. A failed run is recorded and the rest go on.
    ``runner`` defaults to :func:`experiments.runner.run.run_job`; ``on_result`` sees the results so far
    after each run (the CLI rewrites the table then)."""
    if runner is None:
        from ..runner.run import run_job

        runner = run_job
    runs = cfg.out / "runs"
    if runs.is_dir() and any(runs.iterdir()):  # a run's metrics.jsonl would be appended to, its curve mixed
        raise ConfigError(
            f"invalid config: out={cfg.out} already holds runs ({runs}); choose a new out= "
            "(the default is a new time-stamped directory)"
        )
    for s in cfg.schemes:  # the whole config, once per scheme, before the first run
        compose(cfg.run_overrides(s, cfg.seeds[0]))
    results: list[RunResult] = []
    for seed in cfg.seeds:
        for scheme in cfg.schemes:
            run_dir = cfg.out / "runs" / scheme / f"seed{seed}"
            print(f"converge: {scheme} seed {seed} -> {run_dir}", file=sys.stderr, flush=True)
            try:
                res = RunResult(
                    scheme=scheme, seed=seed, run_dir=run_dir, summary=runner(cfg.run_overrides(scheme, seed), run_dir)
                )
            except Exception as e:
                msg = f"{type(e).__name__}: {e}".strip()
                print(f"converge: {scheme} seed {seed} FAILED: {msg.splitlines()[0]}", file=sys.stderr, flush=True)
                if not isinstance(e, ConfigError):
                    traceback.print_exc(file=sys.stderr)
                res = RunResult(scheme=scheme, seed=seed, run_dir=run_dir, error=msg)
            results.append(res)
            if on_result is not None:
                on_result(results)
    return results


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
    failed = [r for r in results if r.error]
    if failed:
        lines += ["", "Failed runs:", ""] + [
            f"- {r.scheme} seed {r.seed} (`{r.run_dir}`): {r.error.splitlines()[0]}" for r in failed if r.error
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


def plot(cfg: SuiteConfig, results: Sequence[RunResult], path: Path) -> Path:
    """``loss.png``: train loss (moving mean) and eval loss vs tokens; per scheme the mean over
    seeds, the band from the lowest to the highest seed."""
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
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _finite(x: Any) -> Any:
    """``x`` with non-finite floats as None (JSON has no NaN)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def write_outputs(cfg: SuiteConfig, results: Sequence[RunResult], *, with_plot: bool = True) -> dict[str, Path]:
    """Write converge.md/.json/.csv (and loss.png) into ``cfg.out``; their paths by kind."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    rows = aggregate(cfg, results)
    paths = {"md": cfg.out / "converge.md", "json": cfg.out / "converge.json", "csv": cfg.out / "converge.csv"}
    paths["md"].write_text(markdown(cfg, rows, results))
    doc = {
        "schemes": list(cfg.schemes),
        "seeds": list(cfg.seeds),
        "overrides": list(cfg.overrides),
        "rows": rows,
        "runs": [{"scheme": r.scheme, "seed": r.seed, "run_dir": str(r.run_dir), "error": r.error} for r in results],
    }
    paths["json"].write_text(json.dumps(_finite(doc), indent=1, allow_nan=False) + "\n")
    with paths["csv"].open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
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
    if with_plot and any(r.summary for r in results):
        paths["png"] = plot(cfg, results, cfg.out / "loss.png")
    return paths


def main(argv: Sequence[str] | None = None, *, runner: Runner | None = None) -> int:
    """The command: 0 when every run finished, 1 when some failed, 2 for a bad setting."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    try:
        cfg = SuiteConfig.from_args(argv)
        results = run_suite(cfg, runner=runner, on_result=lambda rs: write_outputs(cfg, rs, with_plot=False))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    paths = write_outputs(cfg, results)
    print(paths["md"].read_text())
    print("converge: " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    failed = [r for r in results if r.error]
    if failed:
        print(
            f"error: {len(failed)} of {len(results)} runs failed: "
            + ", ".join(f"{r.scheme} seed {r.seed}" for r in failed),
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
