"""ZeRO-Offload / ZeRO-Infinity against the in-memory engine.

Here: the one-process checks. The topic's full description and its gloo-world checks are in
``tests/distributed/test_runtime_offload.py``.
"""

from __future__ import annotations

import pytest

from tests.runtime_helpers import make_model


def test_bad_offload_input_is_refused_before_training(tmp_path):
    from zeropp.runtime import ZeroConfig, ZeroEngine

    with pytest.raises(ValueError, match="offload_optimizer='cpu' needs stage >= 1"):
        ZeroConfig(stage=0, offload_optimizer="cpu")
    with pytest.raises(ValueError, match="offload_param='cpu' offloads stage-3"):
        ZeroConfig(stage=2, offload_param="cpu")
    with pytest.raises(ValueError, match="nvme_path=.*is not an existing directory"):
        ZeroConfig(stage=3, offload_param="nvme", nvme_path=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="needs nvme_path"):
        ZeroConfig(stage=1, offload_optimizer="nvme")
    with pytest.raises(ValueError, match="cpu_adam='avx512' is not a CPU AdamW kernel"):
        ZeroEngine(make_model(), config=ZeroConfig(stage=1, offload_optimizer="cpu"), cpu_adam="avx512")
