"""ZeRO-Offload's gradient landing: each unit's final gradient is copied to the host as soon as it
is reduced, not at the optimizer step, and the step then works on those host buffers.

Reference: the in-memory engine with the same switches. With ``cpu_adam="single"`` the offloaded
step does the same arithmetic on the landed fp32 copies, so losses, norms, fp16 skip decisions
and weights must be bit-identical, with gradient accumulation and in fp16 (loss-scale overflow
skips) too. The order of the landing copies is checked by instrumenting the engine: at stages 2-3
every unit lands during the last micro-step's backward (at least one inside autograd's backward
itself, before the engine's end-of-backward flush), none in earlier micro-steps; at stage 1 they
land as the after-backward reduce-scatters end; always each unit once, before the step.

Here: the one-process checks of this topic; its other tiers' checks are in
``tests/distributed/test_runtime_offload_landing.py``.
"""

from __future__ import annotations

import pytest


def test_nvme_path_that_is_not_writable_is_refused(tmp_path, monkeypatch):
    import os

    from zeropp.runtime import ZeroConfig

    ZeroConfig(stage=1, offload_optimizer="nvme", nvme_path=str(tmp_path))  # writable: accepted
    monkeypatch.setattr(os, "access", lambda *a, **k: False)  # root may write anywhere: pretend not
    with pytest.raises(ValueError, match=r"nvme_path=.*is not writable"):
        ZeroConfig(stage=1, offload_optimizer="nvme", nvme_path=str(tmp_path))
