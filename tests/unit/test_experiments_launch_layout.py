"""The node layout comes from the launcher: under torchrun the topology's nodes x ranks per node
default to what torchrun started (``LOCAL_WORLD_SIZE``, ``GROUP_WORLD_SIZE``), a declared one that
contradicts it is a ConfigError before any rank joins, and the ranks must be numbered node by node.

The environments here are the ones torchrun's elastic agent sets for its workers
(``torch.distributed.elastic.agent.server.local_elastic_agent``); ``torchrun_env`` builds them.
The real two-agent run is in ``test_experiments_e2e.py``.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from zeropp.comm import Topology
from zeropp.comm.layout import LaunchLayout
from zeropp.experiments.launch import LAUNCHED_MARK
from zeropp.experiments.runner.config import ConfigError
from zeropp.experiments.runner.run import check_launch, declared_layout, run_job, validated


def torchrun_env(nodes: int, per_node: int, node: int, local: int) -> dict[str, str]:
    """What torchrun sets in the worker with local rank ``local`` of agent (node) ``node``."""
    return {
        "RANK": str(node * per_node + local),
        "WORLD_SIZE": str(nodes * per_node),
        "LOCAL_RANK": str(local),
        "LOCAL_WORLD_SIZE": str(per_node),
        "GROUP_RANK": str(node),
        "GROUP_WORLD_SIZE": str(nodes),
        "ROLE_RANK": str(node * per_node + local),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "none",
    }


def _cfg(*overrides: str):
    """The composed config of ``python -m experiments.run <overrides>`` (before validation)."""
    import zeropp.experiments.runner.run  # noqa: F401 - registers the generated schema and groups

    with initialize_config_module(config_module="zeropp.conf", version_base="1.3"):
        return compose("config", overrides=list(overrides))


def _launch(env: dict[str, str], *overrides: str):
    """What the runner does on a torchrun rank with ``env``: validate, then check the launch."""
    rc = validated(_cfg(*overrides), list(overrides), env)
    return rc, check_launch(rc, list(overrides), env)


def test_layout_from_torchrun_env() -> None:
    assert LaunchLayout.from_env({"RANK": "0", "WORLD_SIZE": "4"}) is None  # no layout named
    for node in (0, 1):
        for local in (0, 1):
            lay = LaunchLayout.from_env(torchrun_env(2, 2, node, local))
            assert lay is not None
            assert (lay.nodes, lay.ranks_per_node, lay.node, lay.local_rank) == (2, 2, node, local)
            assert lay.topology(tp=2) == Topology(2, 2, tp=2)
            assert Topology(2, 2).node_of(lay.rank) == node  # the topology puts it on its host
    # only LOCAL_WORLD_SIZE (another launcher): the nodes follow from the world size, NODE_RANK names this one
    env = {"RANK": "5", "WORLD_SIZE": "6", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "2"}
    lay = LaunchLayout.from_env(env)
    assert lay is not None and (lay.nodes, lay.ranks_per_node, lay.node) == (3, 2, 2)
    assert lay.describe() == "3 nodes x 2 local ranks"


@pytest.mark.parametrize(
    "env, words",
    [
        # agents with different --nproc-per-node: 3 ranks here, 1 on the other host
        (
            {**torchrun_env(2, 3, 0, 0), "WORLD_SIZE": "4"},
            ["4 ranks on 2 node(s)", "different numbers of ranks", "--nproc-per-node"],
        ),
        # a launcher that numbers ranks round-robin over hosts: rank 1 on node 1
        (
            {**torchrun_env(2, 2, 1, 0), "RANK": "1"},
            ["placed rank 1 on node 1 as local rank 0", "= 2", "contiguous ranks"],
        ),
        ({**torchrun_env(1, 2, 0, 0), "LOCAL_WORLD_SIZE": "two"}, ["LOCAL_WORLD_SIZE='two'", "integer"]),
        ({**torchrun_env(2, 2, 0, 0), "GROUP_RANK": "2"}, ["node=2", "[0, 2)"]),
        # more ranks per node, or more nodes, than ranks in the job
        ({**torchrun_env(1, 4, 0, 0), "LOCAL_WORLD_SIZE": "8"}, ["LOCAL_WORLD_SIZE=8 is more than WORLD_SIZE=4"]),
        (
            {**torchrun_env(2, 2, 0, 0), "GROUP_WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": None},
            ["GROUP_WORLD_SIZE=8 is more than WORLD_SIZE=4"],
        ),
    ],
)
def test_layout_env_that_a_topology_cannot_describe(env: dict[str, str | None], words: list[str]) -> None:
    env = {k: v for k, v in env.items() if v is not None}
    with pytest.raises(ValueError) as e:
        LaunchLayout.from_env(env)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_declared_layout_reads_the_command_line() -> None:
    assert declared_layout(["stage=3", "topology.tp=2", "hydra.run.dir=x"]) == set()
    assert declared_layout(["topology=2x2"]) == {"nodes", "ranks_per_node"}
    assert declared_layout(["+topology.nodes=2"]) == {"nodes"}
    assert declared_layout(["++topology.ranks_per_node=4"]) == {"ranks_per_node"}


def test_topology_defaults_to_the_launchers_layout() -> None:
    """No topology on the command line: every rank of 1 agent x 4 runs 1 node x 4 (the runner's
    own default 2x2 is for the local launcher); 2 agents x 2 run 2 x 2; tp is kept; settings are
    validated against that topology (hpZ groups of 4 need nodes of 4)."""
    for local in range(4):
        rc, placed = _launch(torchrun_env(1, 4, 0, local), "stage=3", "quant=int8")
        assert rc.topology == Topology(1, 4) and rc.describe().endswith(" 1x4")
        assert placed == {"cluster": "torchrun", "nodes": 1, "ranks_per_node": 4, "declared": []}
    rc, _ = _launch(torchrun_env(1, 4, 0, 0), "quant=hpz", "zero.hpz_size=4")  # invalid on the default 2x2
    assert rc.topology == Topology(1, 4) and rc.zero.hpz_size == 4
    rc, _ = _launch(torchrun_env(2, 2, 1, 1), "stage=3", "quant=zeropp", "topology.tp=2", "model=tiny")
    assert rc.topology == Topology(2, 2, tp=2)
    # a declared layout that agrees is kept
    rc, placed = _launch(torchrun_env(2, 2, 0, 1), "topology=2x2")
    assert rc.topology == Topology(2, 2) and placed["declared"] == ["topology.nodes", "topology.ranks_per_node"]
    # not under torchrun: the config as composed
    assert validated(_cfg(), [], {}).topology == Topology(2, 2)


def test_a_declared_layout_that_contradicts_the_launcher_is_refused() -> None:
    """The reported case: two agents x 2 ranks run with topology.nodes=1 topology.ranks_per_node=4
    counted every byte as intra-node; now every rank refuses, naming both layouts and the fix."""
    for node, local in ((0, 0), (1, 1)):
        with pytest.raises(ConfigError) as e:
            _launch(torchrun_env(2, 2, node, local), "topology.nodes=1", "topology.ranks_per_node=4")
        assert str(e.value) == (
            "invalid config: topology says 1 node x 4 ranks but torchrun started 2 nodes x 2 local ranks; drop "
            "topology.nodes topology.ranks_per_node (the launcher's layout is the default) or pass topology.nodes=2 "
            "topology.ranks_per_node=2. To pose as several nodes on one host, launch without torchrun: "
            "python -m experiments.run topology=<nodes>x<ranks per node>"
        )
    # one field declared: the other comes from the launcher, and the declared one must agree
    assert _launch(torchrun_env(2, 2, 0, 0), "topology.nodes=2")[0].topology == Topology(2, 2)
    with pytest.raises(
        ConfigError,
        match=r"topology says 2 nodes x 4 ranks but torchrun started 1 node x 4 local "
        r"ranks; drop topology.nodes \(",
    ):
        _launch(torchrun_env(1, 4, 0, 0), "topology.nodes=2")


def test_launcher_layout_errors_name_the_launch() -> None:
    with pytest.raises(
        ConfigError,
        match=r"topology.tp=2 must be a positive divisor of ranks_per_node=3.*with "
        r"topology.nodes=1 topology.ranks_per_node=3 from the layout torchrun "
        r"started: 1 node x 3 local ranks",
    ):
        _launch(torchrun_env(1, 3, 0, 0), "topology.tp=2", "model=tiny")
    with pytest.raises(ConfigError, match="invalid launch: torchrun placed rank 1 on node 1"):
        _launch({**torchrun_env(2, 2, 1, 0), "RANK": "1"})
    # zero.* checked against the launcher's topology too (hpZ groups of 4 on nodes of 2)
    with pytest.raises(ConfigError, match=r"hpz_size.*from the layout torchrun started: 2 nodes x 2 local ranks"):
        _launch(torchrun_env(2, 2, 0, 0), "quant=hpz", "zero.hpz_size=4")
    # a launcher that names no layout: the world size is still checked
    with pytest.raises(ConfigError, match="torchrun started 3 ranks but topology.nodes x topology.ranks_per_node"):
        _launch({"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0"})


def test_runner_refuses_before_joining(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner's own path under a torchrun environment: the contradiction is a ConfigError
    before the rank joins a process group (nothing listens on the rendezvous address)."""
    monkeypatch.delenv(LAUNCHED_MARK, raising=False)
    for k, v in torchrun_env(2, 2, 1, 0).items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError, match="topology says 1 node x 4 ranks but torchrun started 2 nodes x 2 local"):
        run_job(["topology.nodes=1", "topology.ranks_per_node=4", "logger=none", "model=tiny"], tmp_path)
    assert not (tmp_path / "summary.json").exists() and not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("sweep", [["-m", "quant=none,int8"], ["--multirun", "stage=1,3"], ["sweep=trainers"]])
def test_a_sweep_under_torchrun_is_refused_before_hydra(
    sweep: list[str], monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The command line's own check, first thing in ``cli()`` under a torchrun rank's environment:
    a multirun would make every job re-join the same rendezvous, so it exits 2 naming the way out
    before Hydra composes anything (under a real torchrun: ``test_experiments_e2e.py``'s topology
    refusal, which shows the runner sees that environment there)."""
    import sys

    import zeropp.experiments.runner.run as run

    monkeypatch.delenv(LAUNCHED_MARK, raising=False)
    for k, v in torchrun_env(1, 2, 0, 1).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(sys, "argv", ["zeropp.experiments.run", *sweep])
    monkeypatch.setattr(run, "_hydra_main", lambda: pytest.fail("Hydra ran for a sweep under torchrun"))
    with pytest.raises(SystemExit) as e:
        run.cli()
    assert e.value.code == 2
    err = capfd.readouterr().err
    assert err.startswith("error: multirun/sweeps under torchrun are not supported"), err
    assert "run one job per torchrun, or sweep with `python -m experiments.run -m ...` locally" in err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_while_hydra_composes_is_one_line_and_its_status(
    sig: signal.Signals, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C (or SIGTERM: ``timeout``, ``kill``) after the imports but before any rank starts
    (Hydra composing the config, the pre-launch checks): one ``error:`` line and 128 + the
    signal, as once the ranks run (before: Hydra's traceback for SIGINT; SIGTERM ended the
    command without a word). The signal itself is sent, to this process, from inside the app."""
    import sys

    import zeropp.experiments.runner.run as run

    def interrupted() -> None:
        os.kill(os.getpid(), sig)
        time.sleep(5)  # the handler raises here
        pytest.fail(f"{sig.name} did not stop the command")

    monkeypatch.delenv(LAUNCHED_MARK, raising=False)
    monkeypatch.setattr(sys, "argv", ["zeropp.experiments.run", "model=tiny"])
    monkeypatch.setattr(run, "_hydra_main", interrupted)

    def unhandled(signum: int, frame: object) -> None:
        pytest.fail("the command left SIGTERM to the process's handler (by default: the end, without a word)")

    before = signal.signal(signal.SIGTERM, unhandled)
    try:
        with pytest.raises(SystemExit) as e:
            run.cli()
        assert signal.getsignal(signal.SIGTERM) is unhandled  # the command's own handler is gone afterwards
    finally:
        signal.signal(signal.SIGTERM, before)
    assert e.value.code == 128 + sig
    assert capfd.readouterr().err == f"error: interrupted by {sig.name}; stopped\n"
