"""A diverging run stops as an error: one message, exit status 3, ``"status": "diverged"``, no
checkpoint of the diverging step.

Here: the one-process checks. The topic's full description and its end-to-end checks are in
``tests/e2e/test_experiments_diverge.py``.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch

from zeropp.experiments.launch import RankFailure
from zeropp.experiments.runner.config import from_dict
from zeropp.experiments.runner.run import recorded_divergence
from zeropp.experiments.runner.torch_trainers import TorchTrainer
from zeropp.experiments.runner.trainers import build_model
from zeropp.runtime.divergence import EXIT_CODE


def test_the_runner_reports_only_a_divergence_this_launch_recorded(tmp_path: Path) -> None:
    """An older run's diverged summary in the same directory does not relabel another failure."""
    f = tmp_path / "summary.json"
    rec = {"step": 4, "reason": "non_finite", "loss": "nan", "grad_norm": 1.0, "message": "training diverged at step 4"}
    f.write_text(json.dumps({"status": "diverged", "divergence": rec}))
    assert recorded_divergence(f, time.time_ns() + 10**9) is None  # written before this launch started
    err = recorded_divergence(f, 0)
    assert isinstance(err, RankFailure) and err.exit_code == EXIT_CODE and str(err) == "training diverged at step 4"
    assert err.divergence.step == 4 and math.isnan(err.divergence.loss)
    f.write_text(json.dumps({"status": "completed", "divergence": None}))
    assert recorded_divergence(f, 0) is None
    os.remove(f)
    assert recorded_divergence(f, 0) is None


def test_torch_trainer_makes_no_update_from_a_non_finite_step() -> None:
    """The DDP/FSDP2 loop without its wrapper (no process group needed): lr=1e30 blows the weights
    up at step 1, step 2's gradient norm is NaN, and that step changes neither the weights nor the
    optimizer state nor the LR schedule."""
    cfg = from_dict(
        {
            "model": {"n_layers": 1, "d_model": 16, "n_heads": 2, "vocab_size": 64, "seq_len": 8},
            "data": {"kind": "random"},
            "trainer": {"name": "ddp"},
            "optim": {"lr": 1e30},
            "topology": {"nodes": 1, "ranks_per_node": 1},
        }
    )
    trainer = TorchTrainer(build_model(cfg, torch.device("cpu")), cfg, autocast=False)
    g = torch.Generator().manual_seed(0)
    batch = [(torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 8), generator=g))]
    first = trainer.train_step(batch)
    assert not first.skipped and math.isfinite(first.loss) and math.isfinite(first.grad_norm)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    steps_before = [int(s["step"]) for s in trainer.opt.state.values()]
    second = trainer.train_step(batch)
    assert second.skipped and not math.isfinite(second.grad_norm) and not math.isfinite(second.loss)
    assert all(torch.equal(v, before[k]) for k, v in trainer.model.state_dict().items())
    assert [int(s["step"]) for s in trainer.opt.state.values()] == steps_before
    assert trainer.sched.last_epoch == 1 and all(p.grad is None for p in trainer.model.parameters())
