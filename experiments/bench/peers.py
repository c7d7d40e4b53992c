"""zeropp against the peers users would pick instead, on one job: DDP, FSDP2, DeepSpeed ZeRO-3.

    python -m experiments.bench_peers                              # 4 ranks, GPT "small", fp32, every row
    python -m experiments.bench_peers --only ddp,deepspeed,stage3 --rounds 3 --steps 10
    python -m experiments.bench_peers --precision bf16 --json --out runs/peers

Every row is a runner job (``experiments.runner.run.run_job``) with identical overrides apart from its
trainer, stage and ``quant=`` recipe: the same model initialisation, data and per-rank batches, torch's
AdamW with the same LR schedule, precision (``zero.precision``) and steps, each in a freshly started
world. The rows: plain DDP (``trainer=ddp``, the baseline of every ratio), FSDP2 (``trainer=fsdp2``),
DeepSpeed ZeRO-3 (``trainer=deepspeed stage=3``; skipped, with the install hint, when DeepSpeed is
not installed), and zeropp's ZeroEngine at stages 0-3, at stage 3 with coalesced units and
``keep_at_turn``, with ``zero.transport`` pinned to ``shm`` (rows ending in ``s``) or to ``backend``
(gloo, rows ending in ``b``; the default ``auto`` picks ``shm`` for CPU ranks of one host), and at
stage 3 with a ZeRO++ recipe (``--quant``).

Rounds are interleaved: round 1 runs every row once, then round 2, ... (each round starting one row
later than the one before, so no row always runs first or right after the same neighbour), and each
figure is the median over the rounds. On a shared machine the load drifts over minutes; interleaving
spreads that drift over all rows alike instead of charging it to whichever ran last.

Figures per row: steps/s (1 / the median step time of rank 0 after ``--warmup``; a synchronous step
ends with its collectives, so rank 0 waits for the slowest rank) and its ratio to DDP's; peak RSS per
rank (the largest rank's lifetime peak resident set, ``getrusage``, as the runner records it in
``memory_by_phase``: everything the process held, activations, allocator slack and imported libraries
included); model-state bytes of the largest rank (``memory_max_rank_bytes``); and the loss drift
against DDP, the largest ``|loss - DDP loss|`` over the steps of the first round (every round trains
the same steps on the same data, so rounds differ in time only).

``experiments.bench_fsdp`` is this benchmark reduced to two rows (zeropp stage 3, optionally with a
recipe, and FSDP2) and one round, printed as its ratio table.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

from zeropp.comm.spec import RECIPES
from zeropp.output_files import path_text_arg

from ..launch.command import run_command
from .args import check_fresh_out, check_hosts, check_jobs, check_run_lengths, interleaved_rounds, require_at_least

RunJob = Callable[[list[str], Path], dict[str, Any]]
"""``run_job(overrides, run_dir) -> summary``: the runner's, or a test's fake."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Row:
    """One row of the table: a trainer and what makes it that row."""

    label: str
    """What the table calls it."""
    overrides: tuple[str, ...]
    """The runner overrides of this row (trainer, stage); the shared ones are added to them."""
    zeropp: bool = False
    """Whether it is ZeroEngine (its stage-3 rows then take ``--prefetch``, and the ZeRO++ row ``--quant``)."""

    def __post_init__(self) -> None:
        if not any(o.startswith("trainer=") for o in self.overrides):
            raise ValueError(f"Row {self.label!r}: its overrides must name the trainer")

    @property
    def trainer(self) -> str:
        """The runner's ``trainer=`` of this row."""
        return next(o.removeprefix("trainer=") for o in self.overrides if o.startswith("trainer="))

    @property
    def prefetches(self) -> bool:
        """Whether ``--prefetch`` reaches this row: a ZeroEngine row at stage 3 (the runner refuses a
        prefetch depth at stages 0-2, where nothing is gathered)."""
        return self.zeropp and "stage=3" in self.overrides


ROWS: dict[str, Row] = {
    "ddp": Row(label="DDP", overrides=("trainer=ddp",)),
    "fsdp2": Row(label="FSDP2", overrides=("trainer=fsdp2",)),
    "deepspeed": Row(label="DeepSpeed ZeRO-3", overrides=("trainer=deepspeed", "stage=3")),
    **{
        f"stage{s}": Row(label=f"zeropp stage {s}", overrides=("trainer=zeropp", f"stage={s}"), zeropp=True)
        for s in range(4)
    },
    "stage3c": Row(
        label="zeropp stage 3, coalesce_numel=4M",
        overrides=("trainer=zeropp", "stage=3", "zero.coalesce_numel=4000000"),
        zeropp=True,
    ),
    "stage3k": Row(
        label="zeropp stage 3, keep_at_turn",
        overrides=("trainer=zeropp", "stage=3", "zero.keep_at_turn=true"),
        zeropp=True,
    ),
    "stage3ck": Row(
        label="zeropp stage 3, coalesce_numel=4M, keep_at_turn",
        overrides=("trainer=zeropp", "stage=3", "zero.coalesce_numel=4000000", "zero.keep_at_turn=true"),
        zeropp=True,
    ),
    **{
        f"stage{s}{k}": Row(
            label=f"zeropp stage {s}, transport={t}",
            overrides=("trainer=zeropp", f"stage={s}", f"zero.transport={t}"),
            zeropp=True,
        )
        for s in range(4)
        for k, t in (("s", "shm"), ("b", "backend"))
    },
    "stage3cks": Row(
        label="zeropp stage 3, coalesce_numel=4M, keep_at_turn, transport=shm",
        overrides=(
            "trainer=zeropp",
            "stage=3",
            "zero.coalesce_numel=4000000",
            "zero.keep_at_turn=true",
            "zero.transport=shm",
        ),
        zeropp=True,
    ),
    "stage3ckb": Row(
        label="zeropp stage 3, coalesce_numel=4M, keep_at_turn, transport=backend",
        overrides=(
            "trainer=zeropp",
            "stage=3",
            "zero.coalesce_numel=4000000",
            "zero.keep_at_turn=true",
            "zero.transport=backend",
        ),
        zeropp=True,
    ),
    "zeropp": Row(label="zeropp ZeRO++", overrides=("trainer=zeropp", "stage=3"), zeropp=True),
}
"""Row key -> row, in table order."""

BASELINE = "ddp"
"""The row every ratio and loss drift is taken against."""


def common_overrides(a: argparse.Namespace) -> list[str]:
    """The overrides every row shares: model, data, batches, steps, precision, optimizer, launcher."""
    return [
        f"topology.nodes={a.nodes}",
        f"topology.ranks_per_node={a.world // a.nodes}",
        f"model={a.preset}",
        f"model.seq_len={a.seq}",
        f"train.micro_batch_size={a.batch}",
        f"train.steps={a.warmup + a.steps}",
        f"train.throughput_skip_steps={a.warmup}",
        f"zero.precision={a.precision}",
        f"optim.lr={a.lr}",
        "data=random",
        "logger=none",
        "launcher.progress=false",
        f"launcher.device={a.device}",
        f"launcher.threads_per_rank={a.threads}",
        f"launcher.timeout_s={a.timeout}",
    ]


def job_overrides(a: argparse.Namespace, key: str) -> list[str]:
    """The runner overrides of row ``key``: its own, then the shared ones."""
    row = ROWS[key]
    own = list(row.overrides)
    if row.zeropp:
        own.append(f"quant={a.quant if key == 'zeropp' else 'none'}")
        if row.prefetches:
            own.append(f"zero.prefetch_depth={a.prefetch}")
    return [*own, *common_overrides(a)]


def label(a: argparse.Namespace, key: str) -> str:
    """The row's label, with the ZeRO++ row's recipe."""
    return ROWS[key].label + (f" ({a.quant})" if key == "zeropp" else "")


def missing_package(key: str) -> str | None:
    """Why row ``key`` cannot run here (its trainer's optional package is not installed), or None."""
    from ..runner.trainer_registry import TRAINER_SPECS, missing_requirement

    return missing_requirement(TRAINER_SPECS[ROWS[key].trainer])


def result(summary: dict[str, Any]) -> dict[str, Any]:
    """What a row reads from one run's summary.json."""
    rss = [
        p.get("process", {}).get("peak_rss", 0)
        for rank in summary.get("memory_by_phase") or []
        for p in (rank or {}).values()
    ]
    return {
        "step_s": summary["step_time_s"]["median"],
        "peak_rss_bytes": max(rss, default=0),
        "memory_bytes": summary["memory_max_rank_bytes"],
        "losses": summary["loss"]["curve"],
        "device": summary.get("device"),
        "cpu_s": summary.get("cpu_s_per_step"),  # all ranks, all threads: steadier than steps/s under load
    }


def row_dir(key: str, r: int) -> str:
    """The folder (under ``--out``) of row ``key``'s job in round ``r`` (from 0)."""
    return f"{key}-r{r + 1}"


def run_rounds(a: argparse.Namespace, root: Path, run_job: RunJob) -> dict[str, dict[str, Any]]:
    """Run the chosen rows for ``a.rounds`` interleaved rounds: key -> ``{"runs": [result, ...]}``,
    ``{"skipped": why}`` (its trainer's package is missing) or ``{"error": ...}`` (a failed job: the
    row is not run again, the others go on; ``args.interleaved_rounds``)."""
    skipped = {key: why for key in a.only if (why := missing_package(key))}
    runs: dict[str, list[dict[str, Any]]] = {key: [] for key in a.only if key not in skipped}
    errors: dict[str, dict[str, Any]] = {}
    interleaved_rounds(
        a.only, a.rounds, lambda key, r: result(run_job(job_overrides(a, key), root / row_dir(key, r))), runs, errors
    )
    return {
        key: {"skipped": skipped[key]} if key in skipped else errors.get(key) or {"runs": runs[key]} for key in a.only
    }


def aggregate(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each row that ran: medians over its rounds, ratio of steps/s to the baseline's, loss drift
    against the baseline (None where the baseline did not run)."""
    out: dict[str, dict[str, Any]] = {}
    for key, row in rows.items():
        runs = row.get("runs")
        if not runs:
            out[key] = {k: v for k, v in row.items() if k != "runs"} or {"error": "no round ran"}
            continue
        step_s = statistics.median(x["step_s"] for x in runs)
        cpu = [x["cpu_s"] for x in runs if x.get("cpu_s") is not None]
        out[key] = {
            "step_s": step_s,
            "steps_per_s": 1.0 / step_s if step_s > 0 else float("nan"),
            "step_s_rounds": [x["step_s"] for x in runs],
            "peak_rss_bytes": statistics.median(x["peak_rss_bytes"] for x in runs),
            "memory_bytes": statistics.median(x["memory_bytes"] for x in runs),
            "losses": runs[0]["losses"],
            "device": runs[0]["device"],
            "cpu_s": statistics.median(cpu) if cpu else None,
        }
    base = out.get(BASELINE, {})
    for row in out.values():
        if "step_s" not in row:
            continue
        row["ratio"] = row["steps_per_s"] / base["steps_per_s"] if "steps_per_s" in base else None
        row["cpu_ratio"] = row["cpu_s"] / base["cpu_s"] if row["cpu_s"] and base.get("cpu_s") else None
        row["loss_drift"] = loss_drift(row["losses"], base["losses"]) if "losses" in base else None
    return out


def loss_drift(losses: Sequence[float], reference: Sequence[float]) -> float:
    """The largest ``|loss - reference|`` over the steps both ran."""
    if len(losses) != len(reference):
        raise ValueError(f"loss curves of {len(losses)} and {len(reference)} steps: the rows ran different jobs")
    return max((abs(x - y) for x, y in zip(losses, reference)), default=0.0)


def format_table(out: dict[str, dict[str, Any]], a: argparse.Namespace) -> str:
    """The table: steps/s, ratio to DDP, peak RSS and model state per rank (MiB), loss drift, CPU
    seconds per step (all ranks, every thread) and their ratio to DDP's."""
    ran = [r for r in out.values() if "step_s" in r]
    device = ran[0]["device"] if ran else a.device
    w = max([28, *(len(label(a, key)) + 1 for key in out)])  # the label column fits the longest label
    lines = [
        f"GPT {a.preset} seq {a.seq}, batch {a.batch}/rank, {a.world} ranks ({a.nodes} node(s), {device}), "
        f"{a.precision}; median over {a.rounds} interleaved round(s) of {a.steps} steps after {a.warmup} warm-up",
        f"{'':{w}}{'steps/s':>9}{'/ DDP':>8}{'peak RSS MiB':>14}{'state MiB':>11}{'loss drift':>12}"
        f"{'CPU s/step':>12}{'CPU / DDP':>11}",
    ]
    for key, r in out.items():
        name = label(a, key)
        if "step_s" not in r:
            what = f"skipped: {r['skipped']}" if "skipped" in r else f"failed: {r['error'].splitlines()[0][:100]}"
            lines.append(f"{name:{w}}{what}")
            continue
        ratio = f"{r['ratio']:8.2f}" if r["ratio"] is not None else f"{'-':>8}"
        drift = f"{r['loss_drift']:12.2e}" if r["loss_drift"] is not None else f"{'-':>12}"
        cpu = f"{r['cpu_s']:12.3f}" if r.get("cpu_s") is not None else f"{'-':>12}"
        cpu_ratio = f"{r['cpu_ratio']:11.2f}" if r.get("cpu_ratio") is not None else f"{'-':>11}"
        lines.append(
            f"{name:{w}}{r['steps_per_s']:9.2f}{ratio}{r['peak_rss_bytes'] / 2**20:14.1f}"
            f"{r['memory_bytes'] / 2**20:11.2f}{drift}{cpu}{cpu_ratio}"
        )
    return "\n".join(lines)


def add_job_args(p: argparse.ArgumentParser) -> None:
    """The flags of the job every row runs (shared with ``bench_fsdp``)."""
    p.add_argument("--world", type=int, default=4, help="ranks (processes)")
    p.add_argument("--nodes", type=int, default=1, help="nodes of the Topology (hpZ / qgZ routing); divides --world")
    p.add_argument("--preset", default="small", help="zeropp.models GPT preset (the runner's model=)")
    p.add_argument("--seq", type=int, default=64, help="sequence length")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=8, help="measured steps")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps first")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--prefetch", type=int, default=1, help="zeropp's prefetch depth (its stage-3 rows)")
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="the runner's launcher.device (auto: CUDA when there is a GPU per rank)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per CPU rank")
    p.add_argument("--timeout", type=float, default=600, help="seconds before a world is stopped")
    p.add_argument(
        "--out", type=path_text_arg, default=None, help="keep the run directories here (default: a temporary directory)"
    )


def check_job_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Usage errors (exit 2) of the shared flags."""
    if a.nodes < 1 or a.world % a.nodes:
        p.error(f"--nodes {a.nodes} must divide --world {a.world}")
    check_run_lengths(p, a, ("steps", "batch", "seq"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m experiments.bench_peers",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_job_args(p)
    p.add_argument("--only", default=",".join(ROWS), help=f"comma-separated rows, from {', '.join(ROWS)}")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; each figure is their median")
    p.add_argument("--quant", choices=sorted(RECIPES), default="zeropp", help="the ZeRO++ row's recipe")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of the table")
    a = p.parse_args(argv)
    check_job_args(p, a)
    require_at_least(p, a, ("rounds",), 1)
    a.only = [k.strip() for k in a.only.split(",") if k.strip()]
    unknown = [k for k in a.only if k not in ROWS]
    if unknown or not a.only or len(set(a.only)) != len(a.only):
        p.error(f"--only {','.join(unknown) or '(empty or repeated)'}: choose rows from {', '.join(ROWS)}")
    if a.prefetch != 1 and not any(ROWS[k].prefetches for k in a.only):
        p.error(f"--prefetch {a.prefetch} does nothing without a zeropp stage-3 row in --only; add one, or remove it")
    check_fresh_out(p, a.out, (row_dir(key, r) for key in a.only for r in range(a.rounds)))
    check_jobs(p, {key: job_overrides(a, key) for key in a.only if not missing_package(key)})
    return a


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Send what is written to stdout to stderr, Python's and file descriptor 1 both: the ranks a
    job starts are processes that inherit descriptor 1, so ``redirect_stdout`` alone would let
    their reports into the JSON document."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def main(argv: list[str] | None = None, run_job: RunJob | None = None) -> dict[str, dict[str, Any]]:
    """Run, print the table (or JSON); returns the rows. ``run_job`` defaults to the runner's."""
    a = parse_args(argv)
    if run_job is None:
        from ..runner.run import run_job as runner_job

        ready = [key for key in a.only if not missing_package(key)]
        check_hosts("python -m experiments.bench_peers", {key: job_overrides(a, key) for key in ready})

        run_job = runner_job
    # with --json, stdout carries the JSON document only: each job's own report goes to stderr
    quiet = _stdout_to_stderr() if a.json else contextlib.nullcontext()
    with tempfile.TemporaryDirectory(prefix="bench_peers-") as tmp, quiet:
        out = aggregate(run_rounds(a, Path(a.out or tmp), run_job))
    print(json.dumps(out, indent=2) if a.json else format_table(out, a))
    return out


def _status() -> int:
    """The command: :func:`main`; exit status 1 when a row failed (a skipped row is no failure)."""
    out = main()
    return 1 if any("error" in r for r in out.values()) else 0


def cli() -> NoReturn:
    """The command: :func:`main`, ended by ``launch.command.run_command`` (Ctrl-C or a failed world
    is one ``error:`` line and the shell's exit status, never a traceback)."""
    run_command(_status)


if __name__ == "__main__":
    cli()
