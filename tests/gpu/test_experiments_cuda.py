"""The runner end to end on GPUs: every trainer and quantization preset with launcher.device=cuda
(NCCL), topology 1x1 on one GPU, 1x2 and 2x1 when two GPUs are present. Skipped without CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

FAST = [
    "train.steps=3",
    "train.micro_batch_size=4",
    "model=tiny",
    "logger=none",
    "launcher.progress=false",
    "launcher.device=cuda",
]
QUANTS = {
    "zeropp": ["none", "int8", "int4", "w8g8", "w8g4", "w4g4", "qwz", "hpz", "qgz", "zeropp"],
    "fsdp2": ["none", "hpz"],
    "fsdp2_zeropp": ["int8", "w8g4", "w4g4", "qgz"],
    "ddp": ["none"],
    "ddp_zeropp": ["qgz"],
}


def _topologies() -> list[str]:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return ["1x1"] + (["1x2", "2x1"] if n >= 2 else [])


def _run(args: list[str], run_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run(
        [sys.executable, "-m", "zeropp.experiments.run", *args, f"hydra.run.dir={run_dir}"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.parametrize("topology", _topologies())
@pytest.mark.parametrize("trainer, quant", [(t, q) for t, qs in QUANTS.items() for q in qs])
def test_runner_on_cuda(tmp_path: Path, trainer: str, quant: str, topology: str) -> None:
    s = _run([f"trainer={trainer}", f"quant={quant}", f"topology={topology}", *FAST], tmp_path)
    assert s["backend"] == "nccl" and s["device"].startswith("cuda")
    assert s["tokens_per_s"] > 0 and 0 < s["loss"]["final"] < 10
