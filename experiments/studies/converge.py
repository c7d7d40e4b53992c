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

Here: the run loop (:func:`run_suite`) and the command (:func:`main`); the suite's configuration
is ``converge_suite.py``, its statistics and output files ``converge_report.py``.
"""

from __future__ import annotations

import sys
import traceback
from typing import Callable, NoReturn, Sequence

from ..launch.command import run_command
from ..runner.compose import compose_run
from ..runner.config import ConfigError
from ..runner.launcher import RunInterrupted
from ..runner.preflight import check_local_ranks
from .converge_report import check_out, write_outputs
from .converge_suite import Runner, RunResult, SuiteConfig


def run_suite(
    cfg: SuiteConfig, *, runner: Runner | None = None, on_result: Callable[[list[RunResult]], object] | None = None
) -> list[RunResult]:
    """Run every (seed, scheme) pair, schemes interleaved within a seed so that a drift of the
    host's load touches all schemes alike. A failed run is recorded and the rest go on.
    ``runner`` defaults to :func:`experiments.runner.run.run_job`; ``on_result`` sees the results so far
    after each run (the CLI rewrites the table then)."""
    host_checks = runner is None  # a stand-in runner (the tests') starts no rank on this host
    if runner is None:
        from ..runner.run import run_job

        runner = run_job
    check_out(cfg)
    runs = cfg.out / "runs"
    if runs.is_dir() and any(runs.iterdir()):  # a run's metrics.jsonl would be appended to, its curve mixed
        raise ConfigError(
            f"invalid config: out={cfg.out} already holds runs ({runs}); choose a new out= "
            "(the default is a new time-stamped directory)"
        )
    for s in cfg.schemes:  # the whole config, once per scheme, before the first run
        rc = compose_run(cfg.run_overrides(s, cfg.seeds[0]))
        if host_checks:  # GPUs, local CPU ranks, memory: else every run failed alike, one by one
            check_local_ranks(rc)
    results: list[RunResult] = []
    for seed in cfg.seeds:
        for scheme in cfg.schemes:
            run_dir = cfg.out / "runs" / scheme / f"seed{seed}"
            print(f"converge: {scheme} seed {seed} -> {run_dir}", file=sys.stderr, flush=True)
            try:
                res = RunResult(
                    scheme=scheme, seed=seed, run_dir=run_dir, summary=runner(cfg.run_overrides(scheme, seed), run_dir)
                )
            except RunInterrupted:
                raise  # the suite itself was stopped (Ctrl-C, SIGTERM): no later run starts
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


def main(argv: Sequence[str] | None = None, *, runner: Runner | None = None) -> int:
    """The command: 0 when every run finished, 1 when some failed, 2 for a bad setting, 128 + N when
    stopped by signal N (the runs finished before it are in the tables)."""
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
    except RunInterrupted as e:
        print(f"error: {e}; the runs finished before it are in {cfg.out}", file=sys.stderr)
        return e.exit_code or 1
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


def cli() -> NoReturn:
    """The command: :func:`main`, ended by ``launch.command.run_command`` (Ctrl-C or a failed world
    is one ``error:`` line and the shell's exit status, never a traceback)."""
    run_command(main)


if __name__ == "__main__":
    cli()
