"""zeropp's collectives in a ``torch.profiler`` trace, named after the communication plan.

* one steady-state ZeroEngine step, recorded by the runner's profiler (``experiments.runner.profiling``)
  as one rank of a fake world (``tests/plan_helpers.py``): the trace's call ranges are exactly the
  plan's entries (``CommPlan.range_name``), call for call, for qwZ + hpZ + qgZ's two hops with
  buckets and accumulation, qWD with single cross hops, MixZ++ frozen units and stage 0; each
  quantized call has its quantize / dequantize parts, every wait names a planned collective, and
  qgZ's cross hop is recorded on the comm worker thread;
* with no profiler nothing is recorded and no range name is built;
* the range grammar parses what it writes; ``read_step`` refuses what is not such a trace;
* ``train.profile`` / ``train.profile_steps`` are validated before any rank starts.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.plan_helpers import SMALL_BUCKETS, ZPP, profiled_step_ranges, steady_step_bytes
from tests.runtime_helpers import TINY
from zeropp.comm import Topology, ranges
from zeropp.comm.spec import RECIPES
from zeropp.experiments.runner.config import ConfigError, TrainConfig
from zeropp.experiments.runner.profiling import busy_s, read_step
from zeropp.models import GPT
from zeropp.runtime import ZeroConfig
from zeropp.runtime.plan import build_plan
from zeropp.runtime.plan_kinds import Algo, CommKind, Group

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _lora() -> GPT:
    torch.manual_seed(0)
    return GPT(TINY.with_(lora_rank=4))


CASES: list[tuple[str, int, int, dict[str, Any], Any]] = [
    ("zeropp-2x2-buckets-accum", 4, 2, {**ZPP, **SMALL_BUCKETS, "grad_accum_steps": 2}, None),
    (
        "qwd-stage2-4x1",
        4,
        4,
        dict(stage=2, grads=RECIPES["qgz"].grads, weight_diff=RECIPES["qwd"].weight_diff, **SMALL_BUCKETS),
        None,
    ),
    ("mixz-int8-hpz", 4, 2, dict(stage=3, quantize_frozen="int8", hpz=True, weights=RECIPES["int8"].weights), _lora),
    ("stage0-accum", 4, 2, dict(stage=0, grad_accum_steps=2), None),
    # groups of one: the engine's local copies name each chunk as the backend's calls would
    ("stage3-1x1-buckets-accum", 1, 1, dict(stage=3, grad_accum_steps=2, **SMALL_BUCKETS), None),
    ("hpz-2x1-buckets", 2, 2, dict(stage=3, hpz=True, **SMALL_BUCKETS), None),
    ("stage1", 4, 2, dict(stage=1), None),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_profiled_step_names_every_planned_collective(case: tuple, tmp_path: Path) -> None:
    _, world, nodes, kw, model = case
    trace = tmp_path / "trace.json"
    units = profiled_step_ranges(
        kw, rank=min(1, world - 1), world=world, nodes=nodes, trace=trace, **({"model": model} if model else {})
    )
    step, step_s, spans = read_step(trace)
    assert step == 2 and step_s > 0
    plan = build_plan(units, ZeroConfig(**kw), Topology(nodes=nodes, ranks_per_node=world // nodes))
    planned = collections.Counter(plan.range_name(c) for c in plan.collectives if c.kind != CommKind.CONTROL)
    calls = [s for s in spans if s.parsed.part is None]
    got = collections.Counter(s.name for s in calls if s.parsed.kind != CommKind.CONTROL)
    assert got == planned  # every planned call once per issue, nothing unplanned
    # control: the plan lists the agreement per micro-batch and the loss / norm sum (which also
    # carries stages 2-3's count of late gradients): nothing else
    control = sum(s.parsed.kind == CommKind.CONTROL for s in calls)
    assert control == sum(c.kind == CommKind.CONTROL for c in plan.collectives)
    names = {s.name for s in spans}
    for c in plan.collectives:
        n = plan.range_name(c)
        # quantized on the fly (frozen ones are stored quantized, hpZ's secondary holds qwZ's wire rows)
        if c.spec is not None and not c.frozen and c.group != Group.HPZ:
            assert f"{n}/quantize" in names, n
        if c.spec is not None and c.algo == Algo.RING_AG:
            assert f"{n}/dequantize" in names, n
    planned_units = {
        (str(c.kind), plan.units[c.unit].name + (".frozen" if c.frozen else ""))
        for c in plan.collectives
        if c.unit >= 0
    }
    waits = {(s.parsed.kind, s.parsed.unit) for s in spans if s.parsed.part == "wait"}
    # at world 1 every call is a local copy, finished at issue
    assert waits <= planned_units and (waits or world == 1)
    # the gradient all-reduces of the units kept whole are all issued before the first is waited for
    issued = [s.start_s for s in calls if s.parsed.kind == CommKind.GRAD_ALL_REDUCE]
    waited = [s.start_s for s in spans if s.parsed.kind == CommKind.GRAD_ALL_REDUCE and s.parsed.part == "wait"]
    assert not waited or max(issued) < min(waited), (issued, waited)
    if kw["stage"] == 0 and world > 1:
        assert len(issued) > 1 and len(waited) == len(issued)
    algos = {c.algo for c in plan.collectives}
    if {Algo.A2A_INTRA, Algo.A2A_CROSS} <= algos:  # qgZ's second hop runs on the comm worker: recorded too
        cross = [s for s in calls if s.parsed.hop == "cross"]
        assert cross and not any(s.main for s in cross)


def test_no_profiler_no_ranges_and_no_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a profiler a whole ZeRO++ step neither opens a range nor builds a range name."""

    def boom(*a: object, **k: object) -> None:
        raise AssertionError("a range or a range name was made with no profiler running")

    assert not ranges.enabled()
    monkeypatch.setattr(torch.autograd.profiler, "record_function", boom)
    monkeypatch.setattr(ranges, "call_name", boom)
    monkeypatch.setattr(ranges, "wait_name", boom)
    _, measured = steady_step_bytes({**ZPP, **SMALL_BUCKETS}, rank=0, world=4, nodes=2)
    assert measured


@pytest.mark.parametrize(
    "args,name",
    [
        (("fwd_all_gather", "block0", 2), "zeropp/fwd_all_gather/block0/b2"),
        (("grad_reduce_scatter", "root", 0, "cross"), "zeropp/grad_reduce_scatter/root/b0/cross"),
        (("frozen_all_gather", "block1.frozen", 0), "zeropp/frozen_all_gather/block1.frozen/b0"),
        (("fsdp_all_gather",), "zeropp/fsdp_all_gather"),
        (("reduce_scatter", None, None, "intra"), "zeropp/reduce_scatter/intra"),
    ],
)
def test_range_names_parse_back(args: tuple, name: str) -> None:
    assert ranges.call_name(*args) == name
    p = ranges.parse(name)
    assert p is not None and p.call == name and p.part is None
    q = ranges.parse(f"{name}/quantize")
    assert q is not None and q.part == "quantize" and q.call == name
    assert (p.kind, p.unit, p.bucket, p.hop) == tuple(args) + (None,) * (4 - len(args))


def test_foreign_names_are_not_ranges() -> None:
    assert ranges.parse("gloo:all_gather") is None and ranges.parse("zeropp") is None
    assert ranges.parse("zeropp/step/7").step == 7 and ranges.parse("zeropp/step/x") is None
    w = ranges.parse(ranges.wait_name("bwd_all_gather", "block3"))
    assert (w.kind, w.unit, w.part) == ("bwd_all_gather", "block3", "wait")


def test_busy_time_counts_overlaps_once() -> None:
    from zeropp.experiments.runner.profiling import Span

    def s(a: float, d: float) -> Span:
        return Span(name="zeropp/x", parsed=ranges.parse("zeropp/x"), start_s=a, dur_s=d, tid=0, main=True)

    assert busy_s([s(0, 2), s(1, 2), s(5, 1), s(5.2, 0.1)], lambda _: True) == pytest.approx(4.0)


def test_read_step_refuses_what_is_not_a_profiled_step(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json is not a readable Chrome trace"):
        read_step(bad)
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({"traceEvents": [{"ph": "X", "name": "aten::add", "ts": 0, "dur": 1}]}))
    with pytest.raises(ValueError, match="no zeropp/step/<n> range"):
        read_step(foreign)
    one = tmp_path / "one.json"
    one.write_text(json.dumps({"traceEvents": [{"ph": "X", "name": "zeropp/step/3", "ts": 0, "dur": 1, "tid": 1}]}))
    with pytest.raises(ValueError, match=r"holds steps \[3\], not step 4"):
        read_step(one, 4)


@pytest.mark.parametrize(
    "kw,words",
    [
        (dict(profile_steps=(3,)), "set train.profile=true"),
        (dict(profile=True, profile_steps=(0, 3)), "each in 1..train.steps=4"),
        (dict(profile=True, profile_steps=(5,)), "each in 1..train.steps=4"),
        (dict(profile=True, profile_steps=(2, 2)), "distinct steps"),
        (dict(profile=True, profile_steps=(True,)), "a list of step numbers"),
        (dict(profile="yes"), "train.profile"),
    ],
)
def test_profile_settings_are_checked(kw: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace(".", r"\.").replace("[", r"\[")):
        TrainConfig(steps=4, **kw)


def test_profile_steps_from_the_command_line() -> None:
    """Hydra composes ``train.profile_steps=[4,2]``; the last step is the default."""
    from zeropp.experiments.runner.plan import load_config

    rc = load_config(["model=tiny", "train.steps=5", "train.profile=true", "train.profile_steps=[4,2]"])
    assert rc.train.profile_steps == (4, 2) and rc.train.profiled_steps == (2, 4)
    assert TrainConfig(steps=6, profile=True).profiled_steps == (6,) and TrainConfig(steps=6).profiled_steps == ()


def test_each_chosen_step_gets_its_own_trace(tmp_path: Path) -> None:
    """Steps 3, 4 and 6 of a loop resumed after step 1: one trace each, holding that step only;
    steps before the resumed start are not recorded."""
    from zeropp.experiments.runner.profiling import StepProfiler, trace_path

    with StepProfiler((1, 3, 4, 6), start=1, run_dir=tmp_path, rank=0, device=torch.device("cpu")) as prof:
        for n in range(2, 7):
            with prof.step(n):
                torch.ones(64).sum()
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == [
        "rank0_step3.json",
        "rank0_step4.json",
        "rank0_step6.json",
    ]
    for n in (3, 4, 6):
        steps = {
            ranges.parse(e["name"]).step
            for e in json.loads(trace_path(tmp_path, 0, n).read_text())["traceEvents"]
            if str(e.get("name", "")).startswith("zeropp/step/")
        }
        assert steps == {n}


def test_side_by_side_refuses_a_run_without_its_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``experiments.plan <run dir>`` needs the finished run's summary.json: missing or unreadable,
    it exits 2 saying so, before reading any trace."""
    from zeropp.experiments.runner.plan import main

    assert main([str(tmp_path)]) == 2
    assert "no summary.json in" in capsys.readouterr().err
    for job in ("0", "1"):  # a sweep's directory: its runs are named (before: "the run did not finish")
        (tmp_path / job).mkdir()
        (tmp_path / job / "summary.json").write_text("{}")
    assert main([str(tmp_path)]) == 2
    assert f"is a sweep's directory, not a run's; give one of its runs: {tmp_path / '0'}, {tmp_path / '1'}" in (
        capsys.readouterr().err
    )
    (tmp_path / "summary.json").write_text('{"config": ')
    assert main([str(tmp_path)]) == 2
    assert "holds no readable run config" in capsys.readouterr().err
