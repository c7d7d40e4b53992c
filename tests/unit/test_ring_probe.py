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


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--gbps", "0"], "--gbps=0 is not a rate the emulator can shape"),
        (["--gbps", "1,1e12"], "--gbps=1e+12 is not a rate"),
        (["--nodes", "1"], "the probe needs >= 2 nodes"),
        (["--repeats", "0"], "give counts >= 1"),
    ],
)
def test_bad_flags_are_usage_errors_before_any_cluster(argv, words, capsys, monkeypatch) -> None:
    """Before: --gbps 0 was a ValueError traceback, and --nodes 1 built a cluster (as root) and then
    said its link probe did not run. Nothing is built: building would fail the test here."""
    from zeropp.experiments import cluster

    monkeypatch.setattr(cluster, "EmulatedCluster", lambda *a, **k: pytest.fail("a cluster was built"))
    with pytest.raises(SystemExit) as e:
        ring_probe.main(argv)
    assert e.value.code == 2 and words in capsys.readouterr().err


def test_without_privileges_the_probe_says_why_in_one_line(monkeypatch) -> None:
    from zeropp.experiments.cluster import netns

    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit, match=r"^error: cluster=emulated .* needs root"):
        ring_probe.main(["--gbps", "1"])
