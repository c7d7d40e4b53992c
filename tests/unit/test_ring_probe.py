"""experiments/cluster/ring_probe.py without root.

Here: the one-process checks. The topic's full description and its end-to-end checks are in
``tests/e2e/test_ring_probe.py``.
"""

from __future__ import annotations

import pytest

from zeropp.experiments.cluster import ring_probe


def test_one_node_has_no_cross_node_rate() -> None:
    with pytest.raises(ValueError, match="nodes >= 2"):
        ring_probe.measure_ring_gbps(1, 2, 1.0)
