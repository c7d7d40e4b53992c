"""Cluster emulator: namespaces up and down, shaped link rate, stale cleanup, signals, and
gloo/training across emulated nodes.

Here: the one-process checks. The topic's full description and its end-to-end checks are in
``tests/e2e/test_cluster.py``.
"""

from __future__ import annotations

import pytest

from zeropp.experiments.cluster import ClusterPrivilegeError, EmulatedCluster, netns

# ---------------------------------------------------------------- no privileges needed


def test_bad_spec_and_prefix_are_rejected_with_reasons():
    with pytest.raises(ValueError, match="inter_gbps"):
        EmulatedCluster(2, 2, 0.0)
    with pytest.raises(ValueError, match="prefix"):
        EmulatedCluster(2, 2, 1.0, prefix="Not-OK-too-long")
    c = EmulatedCluster(2, 2, 1.0)
    assert c.world_size == 4 and [c.node_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert c.rank_command_prefix(3)[:3] == ["ip", "netns", "exec"] and c.rank_command_prefix(3)[3].endswith("-n1")
    env = c.rank_env(2, 29500)
    assert env["MASTER_ADDR"] == c.node_address(0) == c.master_addr and env["GLOO_SOCKET_IFNAME"] == c.interface
    assert env["LOCAL_RANK"] == "2" and env["LOCAL_WORLD_SIZE"] == "4"  # one host: index on the host, not the node
    c.down()  # never brought up: a no-op


def test_without_root_the_error_says_why_and_how_to_run_locally(monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(ClusterPrivilegeError, match="root") as e:
        EmulatedCluster(2, 2, 1.0).up()
    assert "cluster=local" in str(e.value)
