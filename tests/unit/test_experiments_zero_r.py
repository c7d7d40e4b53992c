"""train.activation_checkpointing and zero.offload_activations through the runner.

Here: the one-process checks. The topic's full description and its gloo-world checks are in
``tests/distributed/test_experiments_zero_r.py``.
"""

from __future__ import annotations

import pytest

from tests.experiment_helpers import MINI_1X2_CPU
from zeropp.experiments.runner.config import ConfigError
from zeropp.experiments.runner.run import run_job


def test_offload_activations_is_zeropp_only(tmp_path):
    with pytest.raises(ConfigError, match="offload_activations"):
        run_job([*MINI_1X2_CPU, "trainer=fsdp2", "zero.offload_activations=true"], tmp_path / "x")
