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
from typing import Any

from zeropp.comm.spec import RECIPES

from ..runner.config import ConfigError
from ..runner.launcher import RankFailure
from ..runner.run import run_job
from .args import check_run_lengths

TRAINERS = {"ours": "zeropp", "fsdp2": "fsdp2"}
"""Benchmark side -> the runner's ``trainer=``."""


def job_overrides(a: argparse.Namespace, side: str) -> list[str]:
    """The runner overrides of one side: shared ones, plus ours' stage-3 and ZeRO++ settings."""
    common = [
        f"trainer={TRAINERS[side]}",
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
    if side == "ours":
        common += ["stage=3", f"quant={a.quant}", f"zero.prefetch_depth={a.prefetch}"]
    return common


def result(summary: dict[str, Any]) -> dict[str, Any]:
    """What the comparison reads from one run's summary.json."""
    return {
        "step_s": summary["step_time_s"]["median"],
        "memory_bytes": summary["memory_max_rank_bytes"],
        "losses": summary["loss"]["curve"],
        "tokens_per_s": summary["tokens_per_s"],
        "device": summary.get("device"),
        "run_dir": summary.get("run_dir"),
    }


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
    p.add_argument("--world", type=int, default=4, help="ranks (processes)")
    p.add_argument("--nodes", type=int, default=1, help="nodes of the Topology (hpZ / qgZ routing); divides --world")
    p.add_argument("--preset", default="small", help="zeropp.models GPT preset (the runner's model=)")
    p.add_argument("--seq", type=int, default=64, help="sequence length")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=8, help="measured steps")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps first")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--prefetch", type=int, default=1, help="our prefetch depth")
    p.add_argument("--quant", choices=sorted(RECIPES), default="none", help="our ZeRO++ recipe (default none)")
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="the runner's launcher.device (auto: CUDA when there is a GPU per rank)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per CPU rank")
    p.add_argument("--timeout", type=float, default=600, help="seconds before a world is stopped")
    p.add_argument("--out", default=None, help="keep the run directories here (default: a temporary directory)")
    a = p.parse_args(argv)
    if a.nodes < 1 or a.world % a.nodes:
        p.error(f"--nodes {a.nodes} must divide --world {a.world}")
    check_run_lengths(p, a, ("steps", "batch", "seq"))
    return a


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    try:
        with tempfile.TemporaryDirectory(prefix="bench_fsdp-") as tmp:
            root = Path(a.out or tmp)
            ours, fsdp = [result(run_job(job_overrides(a, side), root / side)) for side in ("ours", "fsdp2")]
    except (ConfigError, RankFailure) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2 if isinstance(e, ConfigError) else 1)
    out = compare(ours, fsdp)
    print(format_comparison(out, a))
    return out


if __name__ == "__main__":
    main()
