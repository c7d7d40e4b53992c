"""Communication state per engine / plug-in (``zeropp.comm.CommSession``).

One 2-rank gloo world (run once for the module):

* two engines with different stochastic-rounding seeds and stages, stepping interleaved in one
  process with a plain stochastic ``quantized_reduce_scatter`` (default session) between their
  steps, each give bit for bit the losses, the stochastic call count and the ``CommStats`` they
  give alone (the reference); a control shifts one engine's counter by one and sees other losses,
  so the comparison can tell a shared counter;
* the plain calls land in the default session only (its counter and ``get_comm_stats()``);
* a session's wait hook sees the waits of that session's handles only, and ``CommWatch`` times
  them through it (patching nothing of zeropp's).

Plus single-process checks of the session's own API and of ``CommWatch``'s nested wait timing.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

from tests.runtime_helpers import make_model, rank_batches
from tests.worlds import run_world

STEPS = 3
KINDS = ("fwd_all_gather", "bwd_all_gather", "grad_reduce_scatter")


def _configs():
    from zeropp.comm import QuantSpec
    from zeropp.runtime import ZeroConfig

    a = ZeroConfig(
        stage=3,
        weights=QuantSpec(bits=4, rounding="stochastic", seed=7),
        grads=QuantSpec(bits=4, rounding="stochastic", seed=7),
    )
    b = ZeroConfig(stage=2, grads=QuantSpec(bits=4, rounding="stochastic", seed=11))
    return {"a": a, "b": b}


def _engine(name: str, world: int):
    from zeropp.comm import Topology
    from zeropp.runtime import OptimizerConfig, ZeroEngine

    return ZeroEngine(
        make_model(seed={"a": 0, "b": 1}[name]),
        config=_configs()[name],
        optimizer=OptimizerConfig(lr=1e-2),
        topology=Topology(1, world),
    )


def _record(eng, losses: list[float]) -> dict[str, Any]:
    return {
        "losses": losses,
        "calls": eng.comm_session.stochastic.value,
        "stats": eng.comm_stats.snapshot(),
        "call_counts": eng.comm_stats.calls(),
    }


def _plain_call(rank: int, world: int) -> None:
    """A user's own stochastic reduce-scatter, without a session: the default session's."""
    from zeropp.comm import QuantSpec, quantized_reduce_scatter

    x = torch.full((world * 64,), float(rank + 1))
    quantized_reduce_scatter(torch.empty(64), x, spec=QuantSpec(bits=8, rounding="stochastic", seed=3))


def _world(rank: int, world: int) -> dict[str, Any]:
    from experiments.runner.commwatch import CommWatch
    from zeropp.comm import CommStats, Topology, get_comm_stats, reset_stochastic_calls, stochastic_calls

    out: dict[str, Any] = {}
    alone = {}
    for name in ("a", "b"):
        eng = _engine(name, world)
        losses = [eng.train_step(rank_batches(s, 1, rank, text=True)).loss for s in range(STEPS)]
        alone[name] = _record(eng, losses)
        eng.close()
    out["alone"] = alone

    control = _engine("a", world)
    control.comm_session.stochastic.reset(1)  # what a counter shared with one other call would do
    out["control"] = [control.train_step(rank_batches(s, 1, rank, text=True)).loss for s in range(STEPS)]
    control.close()

    reset_stochastic_calls(0)
    get_comm_stats().reset()
    engines = {name: _engine(name, world) for name in ("a", "b")}
    losses: dict[str, list[float]] = {"a": [], "b": []}
    for s in range(STEPS):
        for name in ("a", "b"):
            losses[name].append(engines[name].train_step(rank_batches(s, 1, rank, text=True)).loss)
            _plain_call(rank, world)
    out["together"] = {name: _record(eng, losses[name]) for name, eng in engines.items()}
    out["default"] = {"calls": stochastic_calls(), "stats": get_comm_stats().snapshot()}

    # wait hooks: a's hook sees a's waits only; CommWatch times a's waits through it
    seen: dict[str, list[str]] = {"a": [], "b": []}

    def hook_for(name: str):
        @contextlib.contextmanager
        def hook(kind: str):
            seen[name].append(kind)
            yield

        return hook

    handles = {name: eng.comm_session.add_wait_hook(hook_for(name)) for name, eng in engines.items()}
    engines["a"].train_step(rank_batches(STEPS, 1, rank, text=True))
    out["hook_a_only"] = {name: sorted(set(k)) for name, k in seen.items()}
    handles["a"].remove()
    seen["a"].clear()
    engines["a"].train_step(rank_batches(STEPS + 1, 1, rank, text=True))
    out["after_remove"] = list(seen["a"])
    handles["b"].remove()

    from zeropp.comm import CommSession, quantized_all_gather
    from zeropp.comm.chain import Deferred

    session = CommSession(Topology(1, world), stats=CommStats())
    original_wait = Deferred.wait
    with CommWatch(Topology(1, world), sessions=[session]) as watch:
        out["deferred_untouched"] = Deferred.wait is original_wait
        out["hooked"] = len(session._wait_hooks)
        watch.take()
        h = quantized_all_gather(torch.empty(world * 4), torch.ones(4), async_op=True, session=session)
        h.wait()
        out["watch_wait_s"] = watch.take()[1]
    out["hooks_left"] = len(session._wait_hooks)
    out["session_calls"] = session.stats.calls()
    for eng in engines.values():
        eng.close()
    return out


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return run_world(_world, 2, timeout=240)


def test_two_engines_interleaved_match_each_alone(world) -> None:
    for r in world:
        for name in ("a", "b"):
            alone, together = r["alone"][name], r["together"][name]
            assert together["losses"] == alone["losses"], (name, together["losses"], alone["losses"])  # bit for bit
            assert together["calls"] == alone["calls"] > 0, (name, together["calls"], alone["calls"])
            assert together["stats"] == alone["stats"] and together["call_counts"] == alone["call_counts"], name
        # a lone engine's counter is its count of quantized (all stochastic) collectives, from 0
        for name in ("a", "b"):
            counts = r["alone"][name]["call_counts"]
            assert r["alone"][name]["calls"] == sum(counts.get(k, 0) for k in KINDS), (name, counts)
        assert "grad_reduce_scatter" in r["alone"]["b"]["call_counts"]
        assert r["alone"]["a"]["stats"] != r["alone"]["b"]["stats"]  # the two engines differ in what they send


def test_the_comparison_sees_a_shifted_counter(world) -> None:
    for r in world:
        assert r["control"] != r["alone"]["a"]["losses"]


def test_plain_calls_use_the_default_session_only(world) -> None:
    for r in world:
        assert r["default"]["calls"] == 2 * STEPS  # one stochastic call per plain reduce-scatter
        assert set(r["default"]["stats"]) == {"reduce_scatter"}  # nothing of the engines' kinds
        for name in ("a", "b"):
            assert "reduce_scatter" not in r["together"][name]["stats"]


def test_wait_hooks_belong_to_their_session(world) -> None:
    for r in world:
        assert r["hook_a_only"]["a"] and r["hook_a_only"]["b"] == [], r["hook_a_only"]
        assert set(r["hook_a_only"]["a"]) <= {"fwd_all_gather", "bwd_all_gather", "grad_reduce_scatter"}
        assert r["after_remove"] == []


def test_commwatch_times_zeropp_waits_through_the_session_hook(world) -> None:
    for r in world:
        assert r["deferred_untouched"] and r["hooked"] == 1 and r["hooks_left"] == 0
        assert r["watch_wait_s"] > 0
        assert r["session_calls"] == {"all_gather": 1}


# ------------------------------------------------------------------ single process
def test_session_checks_its_arguments() -> None:
    from zeropp.comm import CommSession, CommStats, Topology

    with pytest.raises(TypeError, match="Topology or None"):
        CommSession("2x2")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="CommStats or None"):
        CommSession(stats={})  # type: ignore[arg-type]
    s = CommSession(Topology(1, 2))
    assert isinstance(s.stats, CommStats) and s.stochastic.value == 0
    assert [s.stochastic.take() for _ in range(3)] == [0, 1, 2] and s.stochastic.value == 3
    with pytest.raises(ValueError, match="int >= 0"):
        s.stochastic.reset(-1)
    with pytest.raises(TypeError, match="callable"):
        s.add_wait_hook(3)  # type: ignore[arg-type]
    assert CommSession().stats is not CommSession().stats  # nothing shared between two sessions


def test_plugins_refuse_a_session_with_other_settings() -> None:
    from zeropp.comm import CommSession, CommStats, Topology
    from zeropp.comm.ddp import QuantizedAllReduceState
    from zeropp.comm.fsdp import QuantizedAllGather

    s = CommSession(Topology(1, 2))
    with pytest.raises(ValueError, match="either session= or topology=/stats="):
        QuantizedAllGather(None, session=s, stats=CommStats())
    with pytest.raises(ValueError, match="either session= or topology=/stats="):
        QuantizedAllReduceState(grads=None, session=s, topology=Topology(2, 1))
    a, b = QuantizedAllReduceState(grads=None), QuantizedAllReduceState(grads=None)
    assert a.session is not b.session and a.session.stochastic is not b.session.stochastic
    assert QuantizedAllGather(None, session=s, topology=Topology(1, 2)).session is s  # its own settings: fine


def test_commwatch_counts_a_nested_wait_once(monkeypatch) -> None:
    """A backend ``Work.wait`` inside a zeropp handle's wait (the session hook) counts once."""
    from experiments.runner import commwatch
    from zeropp.comm import Topology

    clock = [0.0]
    monkeypatch.setattr(commwatch.time, "perf_counter", lambda: clock[0])
    w = commwatch.CommWatch(Topology(1, 1))
    with w.timing_wait("grad_reduce_scatter"):  # the session hook
        clock[0] += 1.0
        with w.timing_wait():  # Work.wait's wrapper, nested
            clock[0] += 2.0
    assert w.take()[1] == 3.0
    with w.timing_wait():
        clock[0] += 0.5
    assert w.take()[1] == 0.5
