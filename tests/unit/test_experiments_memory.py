"""``python -m experiments.memory``: ``memory.json``, the summary's per-phase memory and the report's
per-phase bars.

Here: the one-process checks. The topic's full description and its end-to-end checks are in
``tests/e2e/test_experiments_memory.py``.
"""

from __future__ import annotations

import pytest
import torch

from zeropp.experiments.runner import memory as memcmd
from zeropp.runtime.memory import expected_by_tier, tier_totals

FAST = ["model=mini", "topology=2x2", "train.micro_batch_size=2", "data.max_bytes=200000"]


def test_predict_only_lists_every_stage_and_offload_choice(capsys):
    out = memcmd.main(["--predict-only", *FAST, "stage=3", "zero.precision=bf16"])
    rows = out["predicted"]
    assert out["measured"] is None
    assert [(r["stage"], r["offload_optimizer"], r["offload_param"]) for r in rows][:2] == [
        (0, "none", "none"),
        (1, "none", "none"),
    ]
    assert len(rows) == 1 + 3 + 3 + 9
    assert [r["chosen"] for r in rows].count(True) == 1 and rows[7]["chosen"] and rows[7]["stage"] == 3
    from zeropp.models import GPTConfig

    psi = GPTConfig.preset("mini").num_params()
    for r in rows:
        want = tier_totals(
            expected_by_tier(
                r["stage"], psi, 4, offload_optimizer=r["offload_optimizer"], offload_param=r["offload_param"]
            )
        )
        assert r["tiers"] == want
        assert (r["swap_buffers_host"] > 0) == ("nvme" in (r["offload_optimizer"], r["offload_param"]))
    text = capsys.readouterr().out
    assert "| *3 | none | none |" in text and "| 3 | nvme | nvme |" in text and f"{psi:,}" in text


def test_bad_override_is_refused_before_anything_runs(capsys):
    with pytest.raises(SystemExit) as e:
        memcmd.main(["--predict-only", "precision=bf16"])
    assert e.value.code == 2 and "precision" in capsys.readouterr().err


def test_trainers_without_phases_get_flat_snapshots():
    from zeropp.experiments.runner.worker import _memory_phases
    from zeropp.runtime.memory import flat_snapshot

    class T:  # DDP / FSDP2: a flat model-state report only
        def memory_report(self):
            return {"params": 40, "grads": 40, "optimizer": 80, "total": 160}

    created = flat_snapshot("model_creation", {"params": 40}, torch.device("cpu"))
    ph = _memory_phases(T(), torch.device("cpu"), created)
    assert list(ph) == ["model_creation", "step"]
    assert ph["step"]["tiers"]["device"]["optimizer"] == 80 and ph["step"]["tier_totals"]["host"] == 0
    assert ph["model_creation"]["total"] == 40
