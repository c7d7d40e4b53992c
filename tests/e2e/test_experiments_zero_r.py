"""train.activation_checkpointing through the runner: the zeropp trainer (stage 3, where the
recomputation re-gathers the block), DDP and FSDP2 (its unshard hooks outside the recomputed
region) give exactly the losses of the same run without it
(fp32); zero.offload_activations is refused for the torch trainers (they would not honour it).

Here: the end-to-end checks of this topic; its other tiers' checks are in
``tests/unit/test_experiments_zero_r.py``.
"""

from __future__ import annotations

import pytest

from tests.experiment_helpers import MINI_1X2_CPU
from zeropp.experiments.runner.run import run_job


@pytest.mark.parametrize("job", [["trainer=zeropp", "stage=3", "quant=none"], ["trainer=ddp"], ["trainer=fsdp2"]])
def test_activation_checkpointing_changes_no_loss(tmp_path, job):
    plain = run_job([*MINI_1X2_CPU, *job], tmp_path / "plain")
    ckpt = run_job([*MINI_1X2_CPU, *job, "train.activation_checkpointing=true"], tmp_path / "ckpt")
    assert len(plain["loss"]["curve"]) == 2
    assert ckpt["loss"]["curve"] == plain["loss"]["curve"]
