"""``python -m experiments.plan``: the printed plan, the timeline PNG and the Chrome trace agree with
the communication plan; bad inputs exit 2 naming the key. Timing is not asserted."""

from __future__ import annotations

import json

import pytest

from zeropp.comm import Topology
from zeropp.experiments.runner.plan import LANES, load_config, main, model_units
from zeropp.runtime.plan import build_plan
from zeropp.runtime.plan_kinds import CommKind


def test_tiny_writes_a_png_and_a_trace_whose_bytes_are_the_plans(tmp_path, capsys) -> None:
    args = ["model=tiny", "quant=zeropp", "topology=2x2", "zero.allgather_bucket_size=1000"]
    assert main([*args, "--nodes", "2,4", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "plan_timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trace = json.loads((tmp_path / "plan_trace.json").read_text())
    rc = load_config(args)
    units = model_units(rc)
    printed = capsys.readouterr().out
    for pid, nodes in enumerate((2, 4)):
        plan = build_plan(units, rc.zero, Topology(nodes=nodes, ranks_per_node=2))
        comm = [
            e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == pid and LANES[e["tid"]].endswith("link")
        ]
        assert {e["name"].split("[")[0] for e in comm} <= {k.value for k in CommKind}
        assert len(comm) == len(plan.collectives)
        assert sum(e["args"]["bytes"] for e in comm) == plan.total_bytes()
        assert any(e["name"] == "fwd_all_gather[1]" for e in comm)  # several buckets per unit
        assert (
            f"{plan.total_bytes() - sum(v for k, v in plan.bytes_by_kind().items() if k.endswith('cross')):,d}"
            in printed
        )


@pytest.mark.parametrize("keep", [False, True])
def test_coalesced_units_are_drawn_as_the_units_the_plan_moves(tmp_path, keep: bool) -> None:
    """With ``zero.coalesce_numel`` the timeline's compute and link intervals are the plan's merged
    units (``block0-1``), each collective once; with ``keep_at_turn`` the merged unit and the root
    have no backward gather in it."""
    args = ["model=tiny", "stage=3", "topology=2x2", "zero.coalesce_numel=100000000", f"zero.keep_at_turn={keep}"]
    assert main([*args, "--nodes", "2", "--out", str(tmp_path)]) == 0
    plan = build_plan(model_units(load_config(args)), load_config(args).zero, Topology(nodes=2, ranks_per_node=2))
    names = [u.name for u in plan.units]
    assert names == ["root", "block0-1"]
    events = [e for e in json.loads((tmp_path / "plan_trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    assert {e["name"] for e in events if LANES[e["tid"]] == "compute"} >= {"fwd block0-1", "bwd block0-1"}
    comm = [e for e in events if LANES[e["tid"]].endswith("link")]
    assert len(comm) == len(plan.collectives)
    assert any(e["name"].startswith("bwd_all_gather") for e in comm) == (not keep)


@pytest.mark.parametrize(
    "argv,key",
    [
        (["model=tiny", "--nodes", "0"], "--nodes"),
        (["model=tiny", "plan.colour=red"], "plan.colour"),
        (["model=tiny", "trainer=ddp"], "trainer=ddp"),
        (["model=tiny", "zero.stage=7"], "stage"),
        (["model=tiny", "plan.cluster_file=/nonexistent/cluster.json"], "plan.cluster_file"),
        (["-m", "model=tiny,mini"], "-m model=tiny,mini: the plan projects one configuration, not a sweep"),
        (["model=tiny", "train.steps=range(1,3)"], "train.steps=range(1,3): the plan projects one configuration"),
        (["model=tiny", "zero.reduce_bucket_size=${oops}"], "zero.reduce_bucket_size: Interpolation key 'oops'"),
        (["model=tiny", "train.steps=a=b)("], "train.steps=a=b)(: Hydra cannot parse this override (mismatched input"),
    ],
)
def test_bad_inputs_exit_2_naming_the_key(argv: list[str], key: str, tmp_path, capsys) -> None:
    assert main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and key in err


def test_the_plan_reads_a_calibrated_cluster_file(tmp_path) -> None:
    from zeropp.experiments.projection.cluster_file import ClusterFile, LinkFit, write_cluster_file
    from zeropp.experiments.runner.plan import _args, project

    path = tmp_path / "cluster.json"
    links = {"intra": LinkFit(alpha_s=7e-6, gbps=900.0), "inter": LinkFit(alpha_s=30e-6, gbps=180.0, ranks=4)}
    write_cluster_file(path, ClusterFile(nodes=2, ranks_per_node=2, backend="nccl", links=links))
    a, rest = _args(["model=tiny", "quant=zeropp", "topology=2x2", f"plan.cluster_file={path}"])
    plain, _ = _args(["model=tiny", "quant=zeropp", "topology=2x2"])
    rc = load_config(rest)
    with_file, without = project(rc, model_units(rc), 2, a), project(rc, model_units(rc), 2, plain)
    c = with_file["cluster"]
    assert (c.alpha_intra_s, c.intra_gbps, c.alpha_cross_s, c.cross_gbps) == (7e-6, 900.0, 30e-6, 180.0)
    assert without["cluster"].cross_gbps == 100.0 and with_file["step_s"] != without["step_s"]


@pytest.mark.parametrize("name", ["plan_timeline.png", "plan_trace.json"])
def test_a_file_of_the_users_in_out_is_refused_and_its_own_replaced(name: str, tmp_path, capsys) -> None:
    """Before: a plan_timeline.png / plan_trace.json of the user's in --out was overwritten (for the
    trace: a profiler trace of the user's, Chrome's format too, is not the plan's)."""
    (tmp_path / name).write_text('{"traceEvents": [], "mine": true}' if name.endswith(".json") else "mine")
    before = (tmp_path / name).read_text()
    assert main(["model=tiny", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / name} exists and is not a file this command can tell it wrote" in err
    assert (tmp_path / name).read_text() == before and len(list(tmp_path.iterdir())) == 1
    own = tmp_path / "own"
    assert main(["model=tiny", "--out", str(own)]) == 0 and main(["model=tiny", "--out", str(own)]) == 0
    assert sorted(p.name for p in own.iterdir()) == ["plan_timeline.png", "plan_trace.json"]


@pytest.mark.parametrize(
    "setting, fix",
    [
        (["zero.offload_optimizer=cpu"], "zero.offload_optimizer=none"),
        (["stage=3", "zero.offload_param=cpu"], "zero.offload_param=none"),
        (["zero.offload_activations=true"], "zero.offload_activations=false"),
        (["train.activation_checkpointing=true"], "train.activation_checkpointing=false"),
    ],
)
def test_a_setting_the_projected_step_leaves_out_is_refused(setting: list[str], fix: str, tmp_path, capsys) -> None:
    """The projection models the collectives and the model's compute only: with offload or ZeRO-R
    it printed and drew exactly the step of the config without them (the same projected ms), under
    the config's name. Now one error line names the setting and the plan to run instead; nothing is
    written to --out."""
    assert main(["model=tiny", *setting, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: invalid config: ") and setting[-1] in err and fix in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []


def test_a_link_rate_another_source_replaces_is_refused(tmp_path, capsys) -> None:
    """``--gbps`` with ``cluster=emulated`` (whose link is ``cluster.inter_gbps``), or ``--gbps`` /
    ``cluster.inter_gbps`` beside a cluster file with an inter-node fit (whose rate replaces them),
    was silently ignored: the plan ran at another rate than the one typed. Now one ``error:`` line."""
    from zeropp.experiments.projection.cluster_file import ClusterFile, LinkFit, write_cluster_file

    cf = tmp_path / "c.json"
    links = {"intra": LinkFit(alpha_s=1e-4, gbps=8.0), "inter": LinkFit(alpha_s=1e-3, gbps=0.98, ranks=4)}
    write_cluster_file(cf, ClusterFile(nodes=2, ranks_per_node=2, backend="gloo", links=links))
    base = ["model=tiny", "topology=2x2", "--out", str(tmp_path / "o")]
    for argv, words in [
        (["cluster=emulated", "--gbps", "5"], "--gbps 5 does nothing with cluster=emulated"),
        (["--gbps", "5", "--cluster-file", str(cf)], "--gbps 5 does nothing with --cluster-file"),
        (["cluster=emulated", "cluster.inter_gbps=3", f"plan.cluster_file={cf}"], "cluster.inter_gbps=3 does nothing"),
    ]:
        assert main([*base, *argv]) == 2
        err = capsys.readouterr().err
        assert words in err and ("0.98 Gbit/s" in err or "cluster.inter_gbps (1)" in err), err
    assert main([*base, "--cluster-file", str(cf)]) == 0  # the file alone, or --gbps alone, still plan
    assert main([*base, "--gbps", "5"]) == 0
