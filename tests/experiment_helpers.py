"""Helpers for tests that drive the experiment runner: the command as a user types it, and what a
run left in its checkpoint directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TINY_RUN = ["model=tiny", "model.seq_len=32", "train.micro_batch_size=4", "data.max_bytes=200000", "logger=none"]
"""Overrides of a run that takes seconds: the tiny GPT on a slice of the text corpus, no logger."""


def run_cli(args: list[str], *, torchrun_ranks: int | None = None,
            env: dict[str, str] | None = None, timeout: float = 150) -> subprocess.CompletedProcess:
    """``python -m zeropp.experiments.run <args>`` (or under ``torchrun --nproc-per-node <n>``),
    output captured, wandb offline, no injected fault inherited from the test's environment."""
    e = {k: v for k, v in os.environ.items() if k != "ZEROPP_INJECT_FAULT"}
    e.update(WANDB_MODE="offline", WANDB_SILENT="true", **(env or {}))
    pre = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(torchrun_ranks),
            "-m"] if torchrun_ranks else [sys.executable, "-m"])
    return subprocess.run([*pre, "zeropp.experiments.run", *args], capture_output=True, text=True, timeout=timeout, env=e, check=False)


def checkpoint_steps(root: Path) -> tuple[int | None, list[int]]:
    """(step of the checkpoint ``root/LATEST`` names, steps of every checkpoint directory under
    ``root``), read from each one's own record, its ``meta.json`` (both trainer families)."""
    def step(d: Path) -> int:
        return int(json.loads((d / "meta.json").read_text())["step"])

    latest = root / "LATEST"
    named = step(root / latest.read_text().strip()) if latest.is_file() else None
    return named, sorted(step(d) for d in root.iterdir() if d.is_dir())
