"""The runner trains the GPT with tied embeddings (its default) on ZeroEngine and on FSDP2.

FSDP2's ``fully_shard`` on the root covers the tied weight (``tok_emb`` and ``head`` are both
outside the blocks); ZeroEngine keeps it as one slot of its root unit. Two steps of ``model=mini``
on 2 ranks each, the job composed from the researcher's overrides and trained by the worker's own
loop on a gloo world (``tests.experiment_helpers.train_in_world``); the summary counts the tied
weight once, and ``model.tie_embeddings=false`` gives the head its own weight.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.experiment_helpers import train_in_world
from zeropp.models import GPTConfig

ARGS = [
    "model=mini",
    "train.steps=2",
    "train.micro_batch_size=2",
    "model.seq_len=32",
    "data.max_bytes=200000",
    "topology=1x2",
    "logger=none",
]


@pytest.mark.parametrize(
    "trainer,extra", [("zeropp", ["stage=3"]), ("fsdp2", []), ("zeropp", ["stage=1", "model.tie_embeddings=false"])]
)
def test_runner_trains_the_tied_gpt(tmp_path: Path, trainer: str, extra: list[str]) -> None:
    s = train_in_world([*ARGS, f"trainer={trainer}", *extra], tmp_path)
    tied = GPTConfig.preset("mini", seq_len=32)
    untied = tied.with_(tie_embeddings=False)
    assert tied.tie_embeddings and tied.num_params() == untied.num_params() - 256 * 64  # one [V, D] matrix less
    want = untied if "model.tie_embeddings=false" in extra else tied
    assert s["model"]["params"] == want.num_params()
    curve = s["loss"]["curve"]
    assert len(curve) == 2 and all(0 < v < 10 for v in curve), curve
