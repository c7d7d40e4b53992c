"""experiments/ring_probe.py without root: its rank program on a local gloo world (the emulated
cluster only adds namespaces around the same processes) and its refusal of a one-node cluster.

Here: the one-process checks of this topic; its other tiers' checks are in ``tests/e2e/test_ring_probe.py``.
"""

from __future__ import annotations

import pytest

from zeropp.experiments import ring_probe


def test_one_node_has_no_cross_node_rate() -> None:
    with pytest.raises(ValueError, match="nodes >= 2"):
        ring_probe.measure_ring_gbps(1, 2, 1.0)
