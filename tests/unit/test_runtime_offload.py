"""ZeRO-Offload / ZeRO-Infinity against the in-memory engine, in one 2-node x 2-rank gloo world.

Reference: the in-memory run of the same switches (itself checked against single-process
torch training by test_runtime_parity.py). With ``cpu_adam="single"`` the offloaded step does the
same arithmetic, so losses, gradient norms and weights must be bit-identical; with the default
fused CPU AdamW (a different rounding of the same update, see ``offload.py``) the whole model's
weights must agree to ``FUSED_TOL`` (norm-relative, all weights as one vector) and the losses to
``FUSED_LOSS_TOL`` (relative). Single weights may differ more: a parameter whose true gradient is
zero (the key bias, by softmax invariance) gets rounding noise as gradient, and Adam turns any
noise into a step of about ``lr`` whose sign the rounding decides; so each weight is only bounded
by ``2 * LR * STEPS``.
Memory: fp32 model state per parameter at 4 ranks is 16 / 10 / 7 / 4 bytes for stages 0-3 (the
master is the parameter, issue 12 item 5), and each offload tier holds the ZeRO-Offload /
ZeRO-Infinity share of the state (within 5%).

Here: the one-process checks of this topic; its other tiers' checks are in
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
