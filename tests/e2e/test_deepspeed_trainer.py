"""``trainer=deepspeed`` as a runner job against plain DDP on the same job: DeepSpeed's ZeRO-3 shards
the model state and trains to the same losses in fp32, gradient accumulation and clipping included.

Skips, with the install hint, where DeepSpeed is not installed (CI installs no optional peers).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.experiment_helpers import MINI_1X2_CPU
from zeropp.experiments.runner.run import run_job

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed: pip install 'zeropp[peers]'"
)

JOB = [*MINI_1X2_CPU, "train.steps=3", "zero.grad_accum_steps=2", "zero.grad_clip=0.05", "zero.precision=fp32"]
"""Three steps of two accumulated micro-batches with the gradient clipped (the mini GPT's norm is
above 0.05, so every step clips): the settings DeepSpeed applies itself."""


def test_deepspeed_zero3_trains_to_ddps_losses_on_sharded_state(tmp_path: Path) -> None:
    ds = run_job(["trainer=deepspeed", "stage=3", *JOB], tmp_path / "deepspeed")
    ddp = run_job(["trainer=ddp", *JOB], tmp_path / "ddp")
    assert ds["trainer"] == "deepspeed" and ds["status"] == "completed"
    drift = max(abs(a - b) for a, b in zip(ds["loss"]["curve"], ddp["loss"]["curve"], strict=True))
    assert drift <= 1e-5, (ds["loss"]["curve"], ddp["loss"]["curve"])
    assert ds["loss"]["curve"][0] != ds["loss"]["curve"][-1]  # it trained
    # ZeRO-3 over 2 ranks: each holds half of the parameters, gradients and AdamW's moments, and
    # DeepSpeed keeps an fp32 master copy of its parameter partition even when training in fp32
    ds_mem, ddp_mem = ds["memory_per_rank"][0], ddp["memory_per_rank"][0]
    assert ds_mem["params"] == pytest.approx(ddp_mem["params"] / 2, rel=0.02)
    assert ds_mem["grads"] == pytest.approx(ddp_mem["grads"] / 2, rel=0.02)
    assert ds_mem["optimizer"] == pytest.approx(ddp_mem["optimizer"] / 2 + ds_mem["params"], rel=0.02)
