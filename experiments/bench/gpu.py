"""One model on one device: plain torch, FSDP2 and our stages 0-3 with and without ZeRO++, step time.

    python -m experiments.bench_gpu                         # the default model (d_model 1024, 12 layers) on the local GPU
    python -m experiments.bench_gpu --jobs stage0,stage3,zeropp --steps 50
    python -m experiments.bench_gpu --device cpu --preset tiny --seq 16 --batch 2 --steps 3 --warmup 1

Every row is a runner job (``experiments.runner.run.run_job``) at world 1 (``topology=1x1``) with the
same model, batch, precision, optimizer and steps; only the trainer, stage and ``quant=`` recipe
differ. At world 1 every collective is a local copy, so a stage's extra time over stage 0 is the
runtime's own overhead (hooks, gathers, frees, quantization), before any network. "torch" is
``trainer=ddp``: at world 1 DDP adds only its bucketing to a plain torch step.

Step time: the median of the measured steps after ``--warmup`` (``train.throughput_skip_steps``);
the ratio is to our stage 0. ``--rounds N`` runs the rows N times, interleaved (each round's order
rotated, as ``bench_peers`` does), and each row's figure is the median over its rounds, with their
range beside it: one run per row cannot rank two rows a few percent apart on a machine whose speed
drifts between jobs. Memory: model-state bytes of the largest rank from the summary
(``memory_max_rank_bytes``: parameters, gradients, optimizer state at the end of backward);
activations and allocator peaks are not in the summary. The default model:
GPT 12 layers x 1024 wide (~150M parameters), 8 sequences of 512 tokens, bf16.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from zeropp.output_files import path_text_arg

from ..launch.command import run_command
from .args import check_fresh_out, check_hosts, check_jobs, check_run_lengths, interleaved_rounds, require_at_least

JOBS: dict[str, tuple[str, list[str]]] = {
    "torch": ("torch (DDP, world 1)", ["trainer=ddp"]),
    "fsdp2": ("FSDP2", ["trainer=fsdp2"]),
    "stage0": ("zeropp stage 0", ["trainer=zeropp", "stage=0"]),
    "stage1": ("zeropp stage 1", ["trainer=zeropp", "stage=1"]),
    "stage2": ("zeropp stage 2", ["trainer=zeropp", "stage=2"]),
    "stage3": ("zeropp stage 3", ["trainer=zeropp", "stage=3"]),
    "stage3k": ("stage 3, keep_at_turn", ["trainer=zeropp", "stage=3", "zero.keep_at_turn=true"]),
    "qwz": ("stage 3 + qwZ (int8)", ["trainer=zeropp", "stage=3", "quant=int8"]),
    "zeropp": ("stage 3 + ZeRO++", ["trainer=zeropp", "stage=3", "quant=zeropp"]),
}
"""Job key -> (row label, the overrides that make that row). Rows print in this order."""

BASELINE = "stage0"
"""The row the time ratios are taken against."""


def job_overrides(a: argparse.Namespace, key: str) -> list[str]:
    """The runner overrides of one row: its own, then the ones every row shares."""
    model = [f"model={a.preset}", f"model.seq_len={a.seq}"]
    for name in ("d_model", "n_layers", "n_heads"):
        if getattr(a, name) is not None:
            model.append(f"model.{name}={getattr(a, name)}")
    return [
        *JOBS[key][1],
        "topology=1x1",
        *model,
        f"train.micro_batch_size={a.batch}",
        f"train.steps={a.warmup + a.steps}",
        f"train.throughput_skip_steps={a.warmup}",
        f"zero.precision={a.precision}",
        "data=random",
        "logger=none",
        "launcher.progress=false",
        f"launcher.device={a.device}",
        f"launcher.timeout_s={a.timeout}",
    ]


def result(summary: dict[str, Any]) -> dict[str, Any]:
    """What a row reads from one run's summary."""
    return {
        "step_s": summary["step_time_s"]["median"],
        "memory_bytes": summary["memory_max_rank_bytes"],
        "tokens_per_s": summary["tokens_per_s"],
        "params": summary.get("model", {}).get("params"),
        "device": summary.get("device"),
    }


def row_dir(a: argparse.Namespace, key: str, r: int) -> str:
    """The folder (under ``--out``) of job ``key``'s run in round ``r`` (from 0)."""
    return key if a.rounds == 1 else f"{key}-r{r + 1}"


def run_all(
    a: argparse.Namespace, root: Path, run_job: Callable[[list[str], Path], dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Run the selected rows for ``a.rounds`` interleaved rounds (``args.interleaved_rounds``: a row
    that fails records its error, is not run again, and the rest still run). Each row that ran: the
    first run's result with ``step_s`` and ``tokens_per_s`` the medians over its rounds and
    ``step_s_rounds`` every round's step time."""
    from ..runner.launcher import RunInterrupted

    def run(key: str, r: int) -> dict[str, Any]:
        got = result(run_job(job_overrides(a, key), root / row_dir(a, key, r)))
        # each run as it lands (stderr: stdout keeps the one table), so a run stopped by a limit shows it
        print(f"{key}: {got['step_s'] * 1e3:.2f} ms/step", file=sys.stderr, flush=True)
        return got

    runs: dict[str, list[dict[str, Any]]] = {key: [] for key in a.jobs}
    errors: dict[str, dict[str, Any]] = {}
    try:
        interleaved_rounds(a.jobs, a.rounds, run, runs, errors)
    except RunInterrupted:  # the benchmark itself was stopped, not a row: the table so far, then stop
        done = summarize(a, runs, errors)
        if done:
            print(format_table(done, a) + "\n(stopped: only the runs that finished before it)", flush=True)
        raise
    return summarize(a, runs, errors)


def summarize(
    a: argparse.Namespace, runs: dict[str, list[dict[str, Any]]], errors: dict[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """The rows of :func:`run_all` from the runs so far (a row with neither a run nor an error is left out)."""
    rows = {}
    for key in a.jobs:
        if key in errors:
            rows[key] = errors[key]
            continue
        if not runs[key]:
            continue
        times = [x["step_s"] for x in runs[key]]
        rows[key] = {
            **runs[key][0],
            "step_s": statistics.median(times),
            "step_s_rounds": times,
            "tokens_per_s": statistics.median(x["tokens_per_s"] for x in runs[key]),
        }
    return rows


def format_table(rows: dict[str, dict[str, Any]], a: argparse.Namespace) -> str:
    """The table: ms per step, ratio to stage 0 (when it ran), model-state MiB, tokens/s."""
    base = rows.get(BASELINE, {}).get("step_s")
    ok = [r for r in rows.values() if "error" not in r]
    device = ok[0]["device"] if ok else a.device
    params = ok[0]["params"] if ok else None
    size = (
        (f"{params / 1e6:.1f}M" if params >= 1e6 else f"{params / 1e3:.1f}k") + " parameters"
        if params
        else "parameters unknown"
    )
    shape = "".join(f", {n}={getattr(a, n)}" for n in ("d_model", "n_layers", "n_heads") if getattr(a, n) is not None)
    lines = [
        f"GPT {a.preset}{shape} ({size}), seq {a.seq}, batch {a.batch}, {a.precision}, world 1 on {device}; "
        f"median of {a.steps} steps after {a.warmup} warm-up"
        + (f"; median over {a.rounds} interleaved rounds (range: their ms/step)" if a.rounds > 1 else ""),
        f"{'':24}{'ms/step':>10}{'/ stage 0':>11}{'state MiB':>11}{'tokens/s':>12}"
        + (f"{'range':>16}" if a.rounds > 1 else ""),
    ]
    for key, r in rows.items():
        label = JOBS[key][0]
        if "error" in r:
            lines.append(f"{label:24}  failed: {r['error'].splitlines()[0][:100]}")
            continue
        ratio = f"{r['step_s'] / base:11.2f}" if base and not math.isnan(base) else f"{'-':>11}"
        spread = ""
        if a.rounds > 1:
            lo, hi = min(r["step_s_rounds"]) * 1e3, max(r["step_s_rounds"]) * 1e3
            spread = f"{f'{lo:.2f}-{hi:.2f}':>16}"
        lines.append(
            f"{label:24}{r['step_s'] * 1e3:10.2f}{ratio}{r['memory_bytes'] / 2**20:11.1f}{r['tokens_per_s']:12.0f}"
            + spread
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m experiments.bench_gpu",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--jobs", default=",".join(JOBS), help=f"comma-separated rows, from {', '.join(JOBS)}")
    p.add_argument("--preset", default="large", help="zeropp.models GPT preset (the runner's model=)")
    p.add_argument("--d-model", dest="d_model", type=int, default=1024, help="model width (0: the preset's)")
    p.add_argument("--n-layers", dest="n_layers", type=int, default=12, help="blocks (0: the preset's)")
    p.add_argument("--n-heads", dest="n_heads", type=int, default=16, help="attention heads (0: the preset's)")
    p.add_argument("--seq", type=int, default=512, help="sequence length")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--steps", type=int, default=20, help="measured steps")
    p.add_argument("--warmup", type=int, default=5, help="unmeasured steps first")
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds; each row's figure is their median")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="cuda", help="the runner's launcher.device")
    p.add_argument("--timeout", type=float, default=1200, help="seconds before a job's world is stopped")
    p.add_argument(
        "--out", type=path_text_arg, default=None, help="keep the run directories here (default: a temporary directory)"
    )
    a = p.parse_args(argv)
    a.jobs = [j.strip() for j in a.jobs.split(",") if j.strip()]
    unknown = [j for j in a.jobs if j not in JOBS]
    if unknown or not a.jobs:
        p.error(f"--jobs {','.join(unknown) or '(empty)'}: choose from {', '.join(JOBS)}")
    require_at_least(p, a, ("d_model", "n_layers", "n_heads"), 0)
    for name in ("d_model", "n_layers", "n_heads"):
        setattr(a, name, getattr(a, name) or None)  # 0: keep the preset's
    check_run_lengths(p, a, ("steps", "batch", "seq", "rounds"))
    check_fresh_out(p, a.out, (row_dir(a, key, r) for key in a.jobs for r in range(a.rounds)))
    check_jobs(p, {key: job_overrides(a, key) for key in a.jobs})
    return a


def main(
    argv: list[str] | None = None, run_job: Callable[[list[str], Path], dict[str, Any]] | None = None
) -> dict[str, dict[str, Any]]:
    """Run and print the table; returns the rows (key -> result or ``{"error": ...}``).
    ``run_job`` defaults to the runner's (tests pass a fake one)."""
    a = parse_args(argv)
    if run_job is None:
        from ..runner.run import run_job as runner_job

        check_hosts("python -m experiments.bench_gpu", {key: job_overrides(a, key) for key in a.jobs})

        run_job = runner_job
    with tempfile.TemporaryDirectory(prefix="bench_gpu-") as tmp:
        rows = run_all(a, Path(a.out or tmp), run_job)
    print(format_table(rows, a))
    return rows


def _status() -> int:
    """The command: :func:`main`, exit status 1 when any cell of the matrix failed, else 0."""
    rows = main()
    return 1 if any("error" in r for r in rows.values()) else 0


def cli() -> NoReturn:
    """The command: :func:`main`, ended by ``launch.command.run_command`` (Ctrl-C or a failed world
    is one ``error:`` line and the shell's exit status, never a traceback)."""
    run_command(_status)


if __name__ == "__main__":
    cli()
