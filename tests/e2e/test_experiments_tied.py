"""The runner trains the GPT with tied embeddings (its default) on ZeroEngine and on FSDP2.

FSDP2's ``fully_shard`` on the root covers the tied weight (``tok_emb`` and ``head`` are both
outside the blocks); ZeroEngine keeps it as one slot of its root unit. Two steps of ``model=mini``
on 2 ranks each, as the researcher types it; the summary counts the tied weight once, and
``model.tie_embeddings=false`` gives the head its own weight.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.experiment_helpers import run_cli_here
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
def test_runner_trains_the_tied_gpt(
    tmp_path: Path, trainer: str, extra: list[str], capfd: pytest.CaptureFixture[str]
) -> None:
    p = run_cli_here([*ARGS, f"trainer={trainer}", *extra, f"hydra.run.dir={tmp_path}"], capfd, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    s = json.loads((tmp_path / "summary.json").read_text())
    tied = GPTConfig.preset("mini", seq_len=32)
    untied = tied.with_(tie_embeddings=False)
    assert tied.tie_embeddings and tied.num_params() == untied.num_params() - 256 * 64  # one [V, D] matrix less
    want = untied if "model.tie_embeddings=false" in extra else tied
    assert s["model"]["params"] == want.num_params()
    curve = s["loss"]["curve"]
    assert len(curve) == 2 and all(0 < v < 10 for v in curve), curve
