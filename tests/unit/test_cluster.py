"""Cluster emulator: namespaces up and down, shaped link rate, stale cleanup, signals, and
gloo/training across emulated nodes.

Here: the one-process checks. The topic's full description and its end-to-end checks are in
``tests/e2e/test_cluster.py``.
"""

from __future__ import annotations

import os
import re
import subprocess

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


@pytest.mark.parametrize(
    "gbps, latency_ms, named",
    [(1e12, 0.0, "inter_gbps=1e+12"), (1e-9, 0.0, "inter_gbps=1e-09"), (1.0, 1e9, "inter_latency_ms=1e+09")],
)
def test_links_the_emulator_cannot_shape_are_refused_before_anything_is_built(gbps, latency_ms, named):
    """A rate in bit/s (1e12) or one tc rounds to nothing (1e-9), or a latency in the wrong unit, is a
    usage error naming the range: before, `tc` refused it after the namespaces were up, quoting its
    own `illegal value for "burst"` / `the "rate" parameter is mandatory`."""
    from zeropp.experiments.bench import cluster as bench_cluster
    from zeropp.experiments.bench import comm as bench_comm
    from zeropp.experiments.cluster.__main__ import main as cluster_cli
    from zeropp.experiments.runner.checks import ConfigError
    from zeropp.experiments.runner.sections import ClusterConfig

    with pytest.raises(ValueError, match=rf"cluster\.{re.escape(named)} is not .* from"):
        EmulatedCluster(2, 2, gbps, latency_ms)
    key = named.split("=")[0]  # the config prints the value as Python does (1000000000000.0)
    with pytest.raises(ConfigError, match=rf"cluster\.{key}=.*allowed: .* to"):
        ClusterConfig(name="emulated", inter_gbps=gbps, inter_latency_ms=latency_ms)
    flags = ["--gbps", f"{gbps:g}", "--latency-ms", f"{latency_ms:g}"]
    for parse in (
        lambda: bench_comm.parse_args(["--cluster", "emulated", *flags]),
        lambda: bench_cluster.parse_args(flags),
        lambda: cluster_cli(["up", *flags]),
    ):
        with pytest.raises(SystemExit) as e:
            parse()
        assert e.value.code == 2


def test_the_cluster_command_refuses_a_bad_prefix_or_shape_with_usage_exit_2(capsys):
    """`python -m experiments.cluster up --gbps 0` (or `--prefix BAD clean`) was a ValueError traceback."""
    from zeropp.experiments.cluster.__main__ import main as cluster_cli

    for argv in (["up", "--gbps", "0"], ["up", "--nodes", "0"], ["--prefix", "BAD", "clean"]):
        with pytest.raises(SystemExit) as e:
            cluster_cli(argv)
        assert e.value.code == 2
        assert "error: " in capsys.readouterr().err


def test_bench_cluster_refuses_one_node_as_a_usage_error(capsys):
    """One node has no cross-node link: before, every job failed alike in the runner."""
    from zeropp.experiments.bench import cluster as bench_cluster

    with pytest.raises(SystemExit) as e:
        bench_cluster.parse_args(["--nodes", "1"])
    assert e.value.code == 2 and "--nodes >= 2" in capsys.readouterr().err


def test_ip_and_tc_off_path_are_named_where_they_are(monkeypatch, tmp_path):
    """iproute2 installed but not on PATH (sudo's or cron's PATH): the error said to install it."""
    if not os.access("/usr/sbin/ip", os.X_OK) and not os.access("/sbin/ip", os.X_OK):
        pytest.skip("needs iproute2 installed in /usr/sbin or /sbin")
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ClusterPrivilegeError, match=rf"found in /(usr/)?sbin, which is not on PATH \({tmp_path}\)"):
        netns.require_privileges()


def test_the_runner_refuses_an_emulated_run_without_privileges_before_the_run_starts(monkeypatch, tmp_path, capfd):
    """Before: the runner announced the run (`zeropp: ... -> DIR`) and wrote DIR/ranks/spec.json,
    and only the emulator's build said it needs root; now it is a host check like the others."""
    from tests.cli_helpers import run_cli

    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    code, err = run_cli(["cluster=emulated", "topology=2x2", "model=tiny"], tmp_path / "run", monkeypatch, capfd)
    assert code == 2 and "error: cluster=emulated cannot build its namespaces:" in err and "needs root" in err
    assert "zeropp: " not in err and not (tmp_path / "run" / "ranks").exists()


def test_a_namespace_of_an_owner_whose_start_time_was_unreadable_is_judged_by_its_pid(monkeypatch):
    """An owner that could not read its start time (``/proc/<pid>/stat``) tags its names
    ``<pid>-0``. Before: other runs compared 0 with the live owner's real start time and removed
    that live run's namespaces as stale. Now such a name is judged by the pid alone."""
    me = os.getpid()
    monkeypatch.setattr(netns, "start_ticks", lambda pid: None)
    assert netns.owner_tag() == f"{me}-0"
    monkeypatch.undo()
    assert netns.owner_alive(f"zpp-{me}-0-0-n1", "zpp")  # live owner: kept
    assert netns.owner_alive(f"zpp-{me}-0-probe", "zpp")
    assert not netns.owner_alive("zpp-999999999-0-0-sw", "zpp")  # no such process: stale


def test_a_namespace_whose_owner_pid_was_reused_is_stale_and_a_live_owners_is_kept(monkeypatch):
    """Names carry the owner's pid and start time (``/proc/<pid>/stat`` field 22, read here on its
    own as the reference): a namespace whose pid now belongs to a process started at another time
    (pid reuse) is stale and cleaned, one of the live owner is kept, other names are not ours.
    Before, a live pid alone made a leftover look live, so it was never cleaned."""
    me = os.getpid()
    with open(f"/proc/{me}/stat") as f:
        start = int(f.read().rsplit(")", 1)[1].split()[19])
    assert netns.owner_tag() == f"{me}-{start}"
    names = {
        f"zpp-{me}-{start}-0-sw": "live",  # this process's
        f"zpp-{me}-{start}-0-n1": "live",
        f"zpp-{me}-{start + 1}-0-n0": "stale",  # the same pid, another process: pid reused
        f"zpp-{me}-{start}-probe": "live",
        f"zpp-{me}-0-n0": "live",  # an older version's name (pid only): judged by the pid
        "zpp-999999999-5-0-sw": "stale",  # no such process
        "zpp-foo": None,  # not a name this package makes: never listed, never deleted
        f"other-{me}-{start}-0-sw": None,
    }
    listing = "\n".join(f"{n} (id: 3)" for n in names)
    monkeypatch.setattr(netns, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 0, listing, ""))
    deleted: list[str] = []
    monkeypatch.setattr(netns, "delete_namespace", deleted.append)
    assert netns.list_namespaces("zpp") == sorted(n for n, v in names.items() if v)
    stale = sorted(n for n, v in names.items() if v == "stale")
    assert sorted(netns.stale_namespaces("zpp")) == stale
    assert sorted(netns.clean("zpp")) == stale == sorted(deleted)
    c = EmulatedCluster(2, 1, 1.0)
    assert c.switch_namespace == f"zpp-{me}-{start}-{c.cluster_id.rsplit('-', 1)[1]}-sw"
    assert netns.owner_pid(c.node_namespace(1), "zpp") == me and netns.owner_alive(c.node_namespace(1), "zpp")
