"""train.activation_checkpointing through the runner's config and training loop: the zeropp trainer
(stage 3, where the recomputation re-gathers the block), DDP and FSDP2 (its unshard hooks outside
the recomputed region) give exactly the losses of the same run without it (fp32); each job is
composed and validated as the command line does it, and trained by the worker's own loop on a
2-rank gloo world (``tests.experiment_helpers.train_in_world``).

Here: the gloo-world checks of this topic; its one-process checks (zero.offload_activations refused
for the torch trainers, ...) are in ``tests/unit/test_experiments_zero_r.py``.
"""

from __future__ import annotations

import pytest

from tests.experiment_helpers import MINI_1X2_CPU, train_in_world


@pytest.mark.parametrize("job", [["trainer=zeropp", "stage=3", "quant=none"], ["trainer=ddp"], ["trainer=fsdp2"]])
def test_activation_checkpointing_changes_no_loss(tmp_path, job):
    plain = train_in_world([*MINI_1X2_CPU, *job], tmp_path / "plain")
    ckpt = train_in_world([*MINI_1X2_CPU, *job, "train.activation_checkpointing=true"], tmp_path / "ckpt")
    assert len(plain["loss"]["curve"]) == 2
    assert ckpt["loss"]["curve"] == plain["loss"]["curve"]
    assert (
        ckpt["config"]["train"]["activation_checkpointing"] and not plain["config"]["train"]["activation_checkpointing"]
    )
