"""Our ZeRO-3 vs PyTorch FSDP2 on the same world: step time and model-state memory.

    python -m experiments.bench_fsdp                      # 4 ranks, GPT "small", fp32
    python -m experiments.bench_fsdp --preset medium --batch 8 --steps 10 --precision bf16
    python -m experiments.bench_fsdp --nodes 2 --quant zeropp --precision bf16    # ours with ZeRO++

Both are runner jobs (``experiments.runner.run.run_job``: ``trainer=zeropp stage=3`` and
``trainer=fsdp2``) with identical overrides otherwise: the same model initialisation, per-rank
batches, optimizer and LR schedule, precision (``zero.precision``) and steps, each in its own
freshly started world. FSDP2 shards with ``fully_shard`` per transformer block plus the root
(experiments/runner/trainers.py); ours is ``ZeroEngine`` at stage 3, optionally with a ZeRO++ recipe
(``--quant``, ours only).

Step time: the median of rank 0's step times after ``--warmup`` (the runner's
``train.throughput_skip_steps``); a synchronous step ends with its collectives, so rank 0 waits
for the slowest rank. Memory: the largest rank's model-state bytes (parameters, gradients,
optimizer state; the summary's ``memory_per_rank``), which is what sharding changes; activations
and allocator overhead are not in it. The goal is ratios <= 1 (ours no slower and no bigger than
FSDP2). Run directories go to a temporary directory, or under ``--out`` to keep them.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any, NoReturn

from zeropp.comm.spec import RECIPES

from ..launch.command import run_command
from ..runner.config import ConfigError
from ..runner.launcher import RankFailure
from ..runner.run import run_job
from . import peers
from .args import check_fresh_out

SIDES = ("ours", "fsdp2")
"""The two sides of the comparison."""


def peer_row(a: argparse.Namespace, side: str) -> str:
    """The :data:`experiments.bench.peers.ROWS` key of one side: ours is stage 3, with ``--quant``
    its ZeRO++ row."""
    if side == "fsdp2":
        return "fsdp2"
    return "stage3" if a.quant == "none" else "zeropp"


def job_overrides(a: argparse.Namespace, side: str) -> list[str]:
    """The runner overrides of one side: the peers benchmark's job of its row."""
    return peers.job_overrides(a, peer_row(a, side))


def compare(ours: dict[str, Any], fsdp: dict[str, Any]) -> dict[str, Any]:
    return {
        "ours": ours,
        "fsdp2": fsdp,
        "time_ratio": ours["step_s"] / fsdp["step_s"],
        "memory_ratio": ours["memory_bytes"] / max(fsdp["memory_bytes"], 1),
    }


def format_comparison(out: dict[str, Any], a: argparse.Namespace) -> str:
    ours, fsdp = out["ours"], out["fsdp2"]
    mb = 1024 * 1024
    head = "zeropp stage 3" + ("" if a.quant == "none" else f" ({a.quant})")
    return "\n".join(
        [
            f"GPT {a.preset} seq {a.seq}, batch {a.batch}/rank, {a.world} ranks ({a.nodes} node(s), {ours['device']}), "
            f"{a.precision}, "
            f"median of {a.steps} steps after {a.warmup} warm-up",
            f"{'':26}{head:>22}{'FSDP2':>12}{'ours/FSDP2':>12}",
            f"{'step time (ms)':26}{ours['step_s'] * 1e3:22.1f}{fsdp['step_s'] * 1e3:12.1f}{out['time_ratio']:12.2f}",
            f"{'model-state memory (MiB)':26}{ours['memory_bytes'] / mb:22.1f}{fsdp['memory_bytes'] / mb:12.1f}"
            f"{out['memory_ratio']:12.2f}",
            f"{'loss, first step':26}{ours['losses'][0]:22.4f}{fsdp['losses'][0]:12.4f}",
            f"{'loss, last step':26}{ours['losses'][-1]:22.4f}{fsdp['losses'][-1]:12.4f}",
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m experiments.bench_fsdp",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    peers.add_job_args(p)
    p.add_argument("--quant", choices=sorted(RECIPES), default="none", help="our ZeRO++ recipe (default none)")
    a = p.parse_args(argv)
    peers.check_job_args(p, a)
    check_fresh_out(p, a.out, SIDES)
    return a


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    try:
        with tempfile.TemporaryDirectory(prefix="bench_fsdp-") as tmp:
            root = Path(a.out or tmp)
            ours, fsdp = [peers.result(run_job(job_overrides(a, side), root / side)) for side in SIDES]
    except (ConfigError, RankFailure) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2 if isinstance(e, ConfigError) else 1)
    out = compare(ours, fsdp)
    print(format_comparison(out, a))
    return out


def cli() -> NoReturn:
    """The command: :func:`main`, ended by ``launch.command.run_command`` (Ctrl-C or a failed world
    is one ``error:`` line and the shell's exit status, never a traceback)."""
    run_command(main)


if __name__ == "__main__":
    cli()
