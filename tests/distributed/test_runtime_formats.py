"""The float and microscaling recipes train like INT4 / INT8: on a 2-node x 2-rank world at stage 3,
``quant=mxfp4`` and ``quant=nvfp4`` stay within the 4-bit band of the unquantized run (the band of
``tests/quant_bands.py``, measured for INT4 in ``test_runtime_zeropp.py``; measured here: MXFP4
2.3%, NVFP4 0.3% at worst), and every step's bytes, per kind and link on every rank, are the
communication plan's (``zeropp.runtime.plan``, the codecs' ``wire_bytes``). The other recipes'
bytes are checked against the plan on a fake world (``tests/unit/test_runtime_plan.py``)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.quant_bands import CFG, LR, STEPS, TOL_4BIT, within_band
from tests.runtime_helpers import train_engine
from tests.worlds import run_world
from zeropp.comm.spec import RECIPES

RUNS: dict[str, tuple[dict[str, Any], float]] = {
    name: (dict(stage=3, weights=RECIPES[name].weights, grads=RECIPES[name].grads), tol)
    for name, tol in (("mxfp4", TOL_4BIT), ("nvfp4", TOL_4BIT))
}
"""Recipe -> (ZeroConfig keyword arguments, band)."""


def _world(rank: int, world: int) -> dict[str, Any]:
    base = train_engine(rank, world, dict(stage=3), steps=STEPS, nodes=2, lr=LR, text=True, consolidate=False, cfg=CFG)
    out = {"base": base["losses"]}
    for name, (kw, _) in RUNS.items():
        r = train_engine(rank, world, kw, steps=STEPS, nodes=2, lr=LR, text=True, consolidate=False, cfg=CFG)
        out[name] = {"losses": r["losses"], "comm_per_step": r["comm_per_step"]}
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_world(_world, 4, timeout=300)


def test_float_recipes_stay_within_the_int_bands(runs) -> None:
    base = runs[0]["base"]
    assert base[0] - min(base) > 0.5, f"training must make progress for the comparison to mean something: {base}"
    for name, (_, tol) in RUNS.items():
        assert runs[0][name]["losses"] != base, f"{name} must quantize something"
        assert not within_band(runs[0][name]["losses"], base, tol), (name, runs[0][name]["losses"], base)


def test_float_recipes_send_the_plans_bytes(runs) -> None:
    from zeropp.comm import Topology
    from zeropp.models import GPT
    from zeropp.runtime import ZeroConfig
    from zeropp.runtime.plan import build_plan, plan_units

    units = plan_units(GPT(CFG))
    for name, (kw, _) in RUNS.items():
        plan = build_plan(units, ZeroConfig(**kw), Topology(nodes=2, ranks_per_node=2)).bytes_by_kind()
        for rank, r in enumerate(runs):
            prev: dict[str, int] = {}
            for step, snap in enumerate(r[name]["comm_per_step"]):  # cumulative after each step
                flat = {f"{k}.{ln}": b for k, links in snap.items() for ln, b in links.items() if b}
                got = {k: b - prev.get(k, 0) for k, b in flat.items() if b - prev.get(k, 0)}
                assert got == plan, (name, rank, step)
                prev = flat
