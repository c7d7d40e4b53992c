"""A trainer registered from outside the harness (``tests.toy_trainer.TOY_SPEC``) is trained by the
worker's own loop, in a 2-rank gloo world, for 2 steps: the loop reaches it through the
``Trainer`` protocol only, and writes its records and summary as for a built-in trainer.

Here: the gloo-world check of this topic; its one-process checks are in
``tests/unit/test_experiments_registry.py`` and ``tests/unit/test_experiments_train_loop.py``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from tests.worlds import run_world


def _train_toy(rank: int, world: int, run_dir: str) -> Any:
    import torch

    from tests.toy_trainer import TOY_SPEC
    from zeropp.experiments.runner.config import from_dict
    from zeropp.experiments.runner.trainer_registry import TRAINER_SPECS
    from zeropp.experiments.runner.worker import _train

    TRAINER_SPECS.setdefault("toy", TOY_SPEC)  # this rank's own registry (a forked process)
    cfg = from_dict(
        {
            "model": {"n_layers": 1, "d_model": 16, "n_heads": 2, "vocab_size": 64, "seq_len": 8},
            "data": {"kind": "random"},
            "trainer": {"name": "toy"},
            "topology": {"nodes": 1, "ranks_per_node": world},
            "logger": {"name": "none", "mode": "disabled"},
            "launcher": {"progress": False},
            "train": {"steps": 2, "micro_batch_size": 2, "eval_every": 1, "eval_batches": 1},
        }
    )
    return _train(cfg, {"label": "toy"}, Path(run_dir), rank, world, torch.device("cpu"), "gloo")


def test_a_registered_trainer_runs_through_the_worker_loop(tmp_path: Path) -> None:
    from zeropp.experiments.runner.metrics import read_metrics

    results = run_world(_train_toy, 2, str(tmp_path))
    summary = results[0]
    assert results[1] is None  # only rank 0 writes the results
    assert summary["status"] == "completed" and summary["trainer"] == "toy" and summary["steps"] == 2
    assert all(math.isfinite(x) for x in summary["loss"]["curve"]) and math.isfinite(summary["loss"]["eval"])
    assert [list(m) for m in summary["memory_by_phase"]] == [["model_creation", "step"]] * 2  # both ranks
    recs = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2]
    assert recs[0]["eval_loss"] is not None and recs[1]["eval_loss"] is None  # step 2 is the last
    assert (tmp_path / "summary.json").is_file() and not (tmp_path / "checkpoints").exists()
