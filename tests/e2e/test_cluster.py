"""Cluster emulator: namespaces up and down, shaped link rate, stale cleanup, signals,
and gloo/training across emulated nodes.

Tests that build namespaces need root and a kernel/container that allows `ip netns add`; they
skip with the reason otherwise. Every cluster a test builds is torn down by a finalizer, and the
last check asserts nothing with this process's id is left behind.

Here: the end-to-end checks of this topic; its other tiers' checks are in ``tests/unit/test_cluster.py``.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from zeropp.experiments.cluster import EmulatedCluster, NetnsError, netns
from zeropp.experiments.launch import ModuleEntry, RankFailure, launch_world
from zeropp.experiments.runner.launcher import cluster_placement

PREFIX = "zpp"


def _netns_unavailable() -> str | None:
    try:
        netns.require_privileges(PREFIX)
    except NetnsError as e:
        return f"emulated-cluster test needs network namespaces: {e}"
    return None


_SKIP = _netns_unavailable()
needs_netns = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")


@pytest.fixture
def clusters():
    """Make clusters; whatever happens in the test, each is torn down afterwards."""
    made: list[EmulatedCluster] = []

    def make(*args, **kw) -> EmulatedCluster:
        c = EmulatedCluster(*args, **kw)
        made.append(c)
        return c.up()

    yield make
    for c in made:
        c.down()


def _ours(c: EmulatedCluster) -> list[str]:
    return [n for n in netns.list_namespaces(PREFIX) if n in c.namespaces()]


def _wait_for(pred, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


# ---------------------------------------------------------------- namespaces


@needs_netns
def test_setup_probe_and_teardown(clusters):
    with open(netns.SLOW_START_AFTER_IDLE) as f:
        host_slow_start = f.read().strip()
    c = clusters(2, 1, 0.5, probe_seconds=1.0)
    assert sorted(_ours(c)) == sorted(c.namespaces())
    # within 20% of the configured rate; the upper bound shows the link really is shaped
    assert c.measured_gbps is not None and abs(c.measured_gbps / 0.5 - 1) < 0.2, c.measured_gbps
    s = c.summary()
    assert s["cluster"] == "emulated" and s["inter_gbps"] == 0.5 and s["measured_gbps"] == c.measured_gbps
    # a fabric: no slow-start restart after idle inside the nodes; the host's own setting untouched
    for i in range(2):
        node = subprocess.run(
            [*c.rank_command_prefix(i), "cat", netns.SLOW_START_AFTER_IDLE], capture_output=True, text=True
        )
        assert node.stdout.strip() == "0", node
    with open(netns.SLOW_START_AFTER_IDLE) as f:
        assert f.read().strip() == host_slow_start
    c.down()
    c.down()  # idempotent
    assert _ours(c) == []


@needs_netns
def test_teardown_after_a_rank_is_killed_and_another_hangs(clusters):
    c = clusters(2, 1, 1.0, probe=False)
    killed = subprocess.Popen([*c.rank_command_prefix(1), "sleep", "60"])
    hung = subprocess.Popen([*c.rank_command_prefix(0), "sleep", "60"])
    _wait_for(lambda: killed.pid in netns.namespace_pids(c.node_namespace(1)), what="rank in node 1")
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=10)
    c.down()
    assert _ours(c) == []
    assert hung.wait(timeout=10) is not None  # teardown stopped the rank still running inside


@needs_netns
def test_stale_namespaces_of_a_killed_owner_are_cleaned_and_live_ones_kept(clusters, tmp_path):
    live = clusters(2, 1, 1.0, probe=False)  # owned by this (live) process: must survive cleaning
    owner = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "zeropp.experiments.cluster",
            "up",
            "--nodes",
            "2",
            "--ranks-per-node",
            "1",
            "--seconds",
            "60",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        mine = lambda: [n for n in netns.list_namespaces(PREFIX) if netns.owner_pid(n, PREFIX) == owner.pid]  # noqa: E731
        _wait_for(lambda: len(mine()) == 3, what="the owner's namespaces")
        owner.send_signal(signal.SIGKILL)  # no handler runs: its namespaces are left behind
        owner.wait(timeout=10)
        left = mine()
        assert len(left) == 3 and set(left) <= set(netns.stale_namespaces(PREFIX))
        fresh = clusters(2, 1, 1.0, probe=False)
        assert set(left) <= set(fresh.cleaned_stale) and mine() == []
        assert sorted(_ours(live)) == sorted(live.namespaces())
    finally:
        if owner.poll() is None:
            owner.kill()
        netns.clean(PREFIX)


@needs_netns
@pytest.mark.parametrize("which", ["switch", "node1", "probe"])
def test_a_namespace_of_that_name_made_before_is_refused_and_left_untouched(which):
    """A namespace that exists under a name the emulator is about to use (a user's: the names carry
    this process's pid and start time) is neither entered, emptied nor deleted: the build is
    refused naming it. Before, the failed build's teardown deleted it (and killed what ran in it)."""
    c = EmulatedCluster(2, 1, 1.0, probe=False)
    probe = f"{PREFIX}-{netns.owner_tag()}-probe"
    name = {"switch": c.switch_namespace, "node1": c.node_namespace(1), "probe": probe}[which]
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        with pytest.raises(NetnsError, match=f"named {name} exists already .* left untouched"):
            c.up()
        assert name in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        assert [n for n in c.namespaces() if n != name and n in netns.list_namespaces(PREFIX)] == []
    finally:
        c.down()
        subprocess.run(["ip", "netns", "del", name], check=False)


@needs_netns
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_the_owner_tears_down(sig):
    # The owner keeps a SIGINT its parent ignores (a shell's `cmd &` does that, and pytest run that
    # way passes it on), so give it the default disposition, as an interactive shell would.
    owner = subprocess.Popen(
        [sys.executable, "-m", "zeropp.experiments.cluster", "up", "--nodes", "2", "--ranks-per-node", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        mine = lambda: [n for n in netns.list_namespaces(PREFIX) if netns.owner_pid(n, PREFIX) == owner.pid]  # noqa: E731
        assert owner.stdout.readline()  # summary printed: the cluster is up and probed
        assert len(mine()) == 3
        owner.send_signal(sig)
        _, err = owner.communicate(timeout=30)
        assert mine() == []
        # Ctrl-C is how `up` is ended: one line and 128 + N (before: a KeyboardInterrupt traceback)
        assert err == f"error: interrupted by {sig.name}; the cluster was removed\n" and owner.returncode == 128 + sig
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(timeout=10)
        netns.clean(PREFIX)


@needs_netns
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_runner_builds_the_cluster_is_one_error_line(sig, tmp_path):
    """SIGTERM while the runner's emulated cluster is built or probed (before the launcher's own
    handlers) ended the runner silently with 143 (SIGINT already ended in one line, through
    KeyboardInterrupt). Now one ``error: interrupted by SIG...`` line, 128 + N, nothing left behind."""
    runner = subprocess.Popen(
        [sys.executable, "-m", "zeropp.experiments.run", "cluster=emulated", "topology=2x2", "model=tiny"]
        + ["train.steps=5", f"hydra.run.dir={tmp_path / 'run'}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        mine = lambda: [n for n in netns.list_namespaces(PREFIX) if netns.owner_pid(n, PREFIX) == runner.pid]  # noqa: E731
        deadline = time.monotonic() + 60
        while len(mine()) < 3 and runner.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)  # the node namespaces exist: the build or the probe is under way
        assert len(mine()) == 3, runner.stderr.read() if runner.poll() is not None else "never built"
        runner.send_signal(sig)
        _, err = runner.communicate(timeout=60)
        assert runner.returncode == 128 + sig, err
        assert err.strip().splitlines()[-1].startswith(f"error: interrupted by {sig.name}"), err
        assert "Traceback" not in err and mine() == []
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait(timeout=10)
        netns.clean(PREFIX)


@needs_netns
def test_latency_is_applied_or_refused_clearly(clusters):
    if not netns.qdisc_supported("netem", PREFIX):
        with pytest.raises(NetnsError, match="netem"):
            clusters(2, 1, 1.0, inter_latency_ms=2.0, probe=False)
        pytest.skip("this kernel has no netem qdisc: latency emulation unavailable (rate shaping still works)")
    c = clusters(2, 1, 1.0, inter_latency_ms=2.0, probe=False)
    c.run_probe()
    assert 3.0 < c.measured_rtt_ms < 8.0, c.measured_rtt_ms  # one-way 2 ms -> RTT ~4 ms


# ---------------------------------------------------------------- ranks across emulated nodes


CHECK = "zeropp.experiments.cluster.check"


@needs_netns
def test_gloo_all_reduce_across_two_emulated_nodes(clusters, tmp_path):
    c = clusters(2, 1, 1.0, probe=False)
    launch_world(
        ModuleEntry(module=CHECK, args=("--out", str(tmp_path))),
        2,
        placement=cluster_placement(c),
        log_dir=tmp_path / "ranks",
        timeout_s=120,
    )  # the one launcher, with the cluster's placement
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["sum"] == r["expected"] == 1.0 and r["big_ok"] for r in reports)
    assert {r["ifname"] for r in reports} == {c.interface}


@needs_netns
def test_launcher_on_a_2x2_emulated_cluster_local_ranks_and_failure(clusters, tmp_path):
    """Ranks in namespaces get the host-wide LOCAL_RANK, and a rank failing there is named."""
    c = clusters(2, 2, 1.0, probe=False)
    placement = cluster_placement(c)
    assert placement.info["cluster"] == "emulated" and placement.master_addr == c.master_addr
    launch_world(
        ModuleEntry(module=CHECK, args=("--out", str(tmp_path / "ok"))),
        4,
        placement=placement,
        log_dir=tmp_path / "ranks",
        timeout_s=120,
    )
    reports = [json.loads((tmp_path / "ok" / f"rank{r}.json").read_text()) for r in range(4)]
    assert all(r["sum"] == r["expected"] == 6.0 and r["big_ok"] and r["ifname"] == c.interface for r in reports)
    assert [r["env"]["LOCAL_RANK"] for r in reports] == ["0", "1", "2", "3"]
    assert {r["env"]["LOCAL_WORLD_SIZE"] for r in reports} == {"4"} and {r["env"]["MASTER_ADDR"] for r in reports} == {
        c.master_addr
    }
    with pytest.raises(RankFailure, match=r"rank 2 \(node 1\) exited with code 1") as e:
        launch_world(
            ModuleEntry(module=CHECK, args=("--out", str(tmp_path / "bad"), "--fail-rank", "2")),
            4,
            placement=placement,
            log_dir=tmp_path / "ranks2",
            timeout_s=120,
            grace_s=2,
            ranks_per_node=2,
        )
    assert "failing on purpose on rank 2" in str(e.value)


@needs_netns
def test_short_zeropp_training_on_a_2x2_emulated_cluster(tmp_path):
    """The runner's own job on the emulated cluster: ranks in their node's namespace, bytes by link,
    and each node's uplink counter per step (``uplink_tx_bytes_per_step``; before: not recorded, so
    ``experiments.bench_cluster``'s uplink comparison never ran)."""
    from zeropp.experiments.bench import cluster as bench_cluster
    from zeropp.experiments.runner.run import run_job

    s = run_job(
        [
            "cluster=emulated",
            "cluster.inter_gbps=1",
            "topology=2x2",
            "model=tiny",
            "stage=3",
            "quant=zeropp",
            "train.steps=3",
            "train.throughput_skip_steps=1",
            "train.micro_batch_size=2",
            "data=random",
            "logger=none",
            "launcher.progress=false",
            "launcher.device=cpu",
        ],
        tmp_path,
    )
    assert all(math.isfinite(x) for x in s["loss"]["curve"]) and len(s["loss"]["curve"]) == 3
    by = s["engine_comm_bytes_per_step"]["by_link"]
    assert by["cross"] > 0 and by["intra"] > 0
    assert s["placement"]["cluster"] == "emulated" and s["placement"]["measured_gbps"] > 0
    # the node's uplink counter: its 2 ranks' cross-node bytes plus TCP/IP headers and the ACKs of
    # what it received (1.15x on the development machine); bench_cluster's uplink table reads it
    uplink, cross = s["uplink_tx_bytes_per_step"], s["comm_bytes_per_step"]["by_link"]["cross"]
    assert 2 * cross <= uplink <= 1.5 * 2 * cross, (uplink, cross)
    assert bench_cluster.aggregate("zeropp", [s])["uplink_bytes"] == uplink


def test_nothing_left_behind():
    """Runs last in this file: no namespace carrying this process's id survives the tests."""
    if _SKIP is not None:
        pytest.skip(_SKIP)
    assert [n for n in netns.list_namespaces(PREFIX) if netns.owner_pid(n, PREFIX) == os.getpid()] == []
