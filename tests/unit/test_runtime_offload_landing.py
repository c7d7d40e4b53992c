"""ZeRO-Offload's gradient landing: each unit's final gradient is copied to the host as soon as it is
reduced, not at the optimizer step, and the step then works on those host buffers.

Here: the one-process checks. The topic's full description and its gloo-world checks are in
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
