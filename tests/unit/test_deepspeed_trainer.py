"""``trainer=deepspeed``'s pieces that need no DeepSpeed: the DeepSpeed config it derives from a run,
and its model-state accounting over DeepSpeed's flat buffers (a storage counted once). The trainer
itself, against DDP, is in ``tests/e2e/test_deepspeed_trainer.py``."""

from __future__ import annotations

import sys

import pytest
import torch

from zeropp.experiments.runner import deepspeed_trainer as dst
from zeropp.experiments.runner.config import from_dict

RUN = {
    "model": {"n_layers": 1, "d_model": 16, "n_heads": 2, "vocab_size": 64, "seq_len": 8},
    "data": {"kind": "random"},
    "topology": {"nodes": 1, "ranks_per_node": 4},
    "trainer": {"name": "deepspeed"},
    "train": {"micro_batch_size": 3},
}


def test_the_deepspeed_config_carries_the_runs_settings() -> None:
    rc = from_dict({**RUN, "zero": {"stage": 2, "grad_accum_steps": 5, "grad_clip": 0.5, "precision": "bf16"}})
    c = dst.ds_config(rc)
    assert c["train_micro_batch_size_per_gpu"] == 3 and c["gradient_accumulation_steps"] == 5
    assert c["train_batch_size"] == 3 * 5 * 4  # DeepSpeed checks micro x accumulation x world
    assert c["gradient_clipping"] == 0.5 and c["zero_optimization"] == {"stage": 2}
    assert c["bf16"] == {"enabled": True} and "optimizer" not in c and "scheduler" not in c
    plain = dst.ds_config(from_dict({**RUN, "zero": {"stage": 3}}))
    assert plain["gradient_clipping"] == 0.0 and plain["bf16"] == {"enabled": False}


def test_views_of_one_flat_buffer_are_counted_once() -> None:
    flat = torch.zeros(100)
    a, b = flat[:40], flat[40:]
    other = torch.zeros(10, dtype=torch.bfloat16)
    seen: set[int] = set()
    assert dst._storages([a, b, None, other, torch.zeros(0)], seen) == 100 * 4 + 10 * 2
    assert dst._storages([flat], seen) == 0  # already counted under another category
    assert dst._flat({"g0": [a, [b]], "g1": (other,)}) == [a, b, other] and dst._flat(None) == []


def test_nothing_imports_deepspeed_until_a_rank_builds_the_trainer(monkeypatch: pytest.MonkeyPatch) -> None:
    """With DeepSpeed unimportable (an ``import deepspeed`` would raise), the registry still resolves
    the builder and a ``trainer=deepspeed`` config still validates: only the builder imports it."""
    import importlib

    from zeropp.experiments.runner.trainer_registry import TRAINER_SPECS, resolve_builder

    monkeypatch.setitem(sys.modules, "deepspeed", None)
    importlib.reload(dst)
    assert resolve_builder(TRAINER_SPECS["deepspeed"]) is dst.build_deepspeed
    assert from_dict({**RUN, "zero": {"stage": 3}}).trainer_spec.requires == "deepspeed"
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # the builder sets it for DeepSpeed; restored after
    with pytest.raises(ImportError, match="deepspeed"):
        dst.build_deepspeed(from_dict(RUN), torch.device("cpu"))
