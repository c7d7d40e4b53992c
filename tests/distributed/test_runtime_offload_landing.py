"""ZeRO-Offload's gradient landing: each unit's final gradient is copied to the host as soon as it
is reduced, not at the optimizer step, and the step then works on those host buffers.

Reference: the in-memory engine with the same switches. With ``cpu_adam="single"`` the offloaded
step does the same arithmetic on the landed fp32 copies, so losses, norms, fp16 skip decisions
and weights must be bit-identical, with gradient accumulation and in fp16 (loss-scale overflow
skips) too. The order of the landing copies is checked by instrumenting the engine: at stages 2-3
every unit lands during the last micro-step's backward (at least one inside autograd's backward
itself, before the engine's end-of-backward flush), none in earlier micro-steps; at stage 1 they
land as the after-backward reduce-scatters end; always each unit once, before the step.

Here: the gloo-world checks of this topic; its other tiers' checks are in
``tests/unit/test_runtime_offload_landing.py``.
"""

from __future__ import annotations

import pytest

from tests.runtime_helpers import make_model, rank_batches
from tests.worlds import run_world

STEPS, ACCUM = 3, 2
F32 = dict(precision="fp32", grad_accum_steps=ACCUM)
FP16 = dict(precision="fp16", loss_scale_init=2.0**18, loss_scale_window=2)  # first steps overflow
CASES = {"s1": dict(F32, stage=1), "s2": dict(F32, stage=2), "s3": dict(F32, stage=3), "s2_fp16": dict(FP16, stage=2)}


def _train(rank: int, kw: dict, offload: bool) -> dict:
    from zeropp.runtime import OptimizerConfig, ZeroConfig, ZeroEngine
    from zeropp.runtime.offload import HostAdamW

    zc = ZeroConfig(**kw, **(dict(offload_optimizer="cpu") if offload else {}))
    log: list[tuple] = []
    land = HostAdamW.land_grad

    def logged_land(self, i, grad):
        log.append(("land", i))
        return land(self, i, grad)

    HostAdamW.land_grad = logged_land  # before the engine binds it
    try:
        eng = ZeroEngine(
            make_model(), config=zc, optimizer=OptimizerConfig(lr=1e-2, weight_decay=0.01), cpu_adam="single"
        )
    finally:
        HostAdamW.land_grad = land

    def wrap(owner: object, attr: str, name: str):
        inner = getattr(owner, attr)

        def call(*args, **kwargs):
            log.append((name, kwargs.get("last")))
            return inner(*args, **kwargs)

        setattr(owner, attr, call)

    for owner, attr, name in (
        (eng, "_after_backward", "_after_backward"),
        (eng.reducer, "final_grads", "_final_grads"),
        (eng.update, "step", "_step"),
    ):
        wrap(owner, attr, name)
    try:
        res = [eng.train_step(rank_batches(s, zc.grad_accum_steps, rank)) for s in range(STEPS)]
        return {
            "losses": [r.loss for r in res],
            "norms": [r.grad_norm for r in res],
            "skipped": [r.skipped for r in res],
            "log": log,
            "n_units": len(eng.units),
            "reduced_in_backward": [i for i, u in enumerate(eng.units) if eng.reducer.reduces_when_ready(u)],
            "weights": {k: v.numpy() for k, v in eng.consolidated_state_dict().items()},
        }
    finally:
        eng.close()


def _world(rank: int, world: int) -> dict:
    return {name: {"mem": _train(rank, kw, False), "cpu": _train(rank, kw, True)} for name, kw in CASES.items()}


@pytest.fixture(scope="module")
def runs():
    return run_world(_world, 2, timeout=240)[0]


def test_landed_gradients_give_the_in_memory_results_bit_for_bit(runs):
    for name, r in runs.items():
        got, want = r["cpu"], r["mem"]
        assert got["losses"] == want["losses"], (name, got["losses"], want["losses"])
        assert list(map(repr, got["norms"])) == list(map(repr, want["norms"])), name  # nan where skipped
        assert got["skipped"] == want["skipped"], name
        for k, v in want["weights"].items():
            assert (got["weights"][k] == v).all(), (name, k)
    fp16 = runs["s2_fp16"]["cpu"]["skipped"]
    assert fp16[0] and not fp16[-1], f"2**18 must overflow fp16 at first, then the scale must recover: {fp16}"


def _steps(log: list[tuple]) -> list[list[tuple]]:
    """The log cut after each ``_step`` entry (one list per train_step)."""
    out, cur = [], []
    for e in log:
        cur.append(e)
        if e[0] == "_step":
            out.append(cur)
            cur = []
    return out


def test_each_unit_lands_once_as_soon_as_it_is_reduced(runs):
    assert all(e[0] != "land" for r in runs.values() for e in r["mem"]["log"])  # no landing without offload
    for name, r in runs.items():
        got, stage, accum = r["cpu"], CASES[name]["stage"], CASES[name].get("grad_accum_steps", 1)
        early = set(got["reduced_in_backward"])
        assert (len(early) > 0) == (stage >= 2), name
        steps = _steps(got["log"])
        assert len(steps) == STEPS, name
        for s, events in enumerate(steps):
            landed = [e[1] for e in events if e[0] == "land"]
            assert sorted(landed) == list(range(got["n_units"])), (name, s, landed)  # each once, before _step
            ends = [k for k, e in enumerate(events) if e[0] == "_after_backward"]
            assert [events[k][1] for k in ends] == [False] * (accum - 1) + [True], (name, events)
            last_end, final = ends[-1], events.index(("_final_grads", None))
            last_start = ends[-2] if accum > 1 else -1  # the last micro-step's backward starts after it
            for k, e in enumerate(events):
                if e[0] != "land":
                    continue
                if e[1] in early:  # reduced during backward: lands in the last micro-step, by its end
                    assert last_start < k < final, (name, s, events)
                else:  # stage 1 / replicated: lands once the after-backward reduction has it
                    assert final < k, (name, s, events)
            if stage >= 2:  # the copies overlap backward: some land before autograd's backward returns
                assert any(e[0] == "land" for e in events[last_start + 1 : last_end]), (name, s, events)
