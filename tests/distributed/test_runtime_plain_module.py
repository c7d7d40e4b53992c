"""A plain ``nn.Sequential`` MLP through ``ZeroEngine``, as a user writes it first: no surprises.

Checked without processes: the default block rule makes each child with parameters of a
``Sequential`` a unit (not the whole model one unit); the stage-3 one-unit warning's condition and
text (names ``blocks=``; silent with several units or below stage 3); a micro-batch the forward
cannot take is a ``MicroBatchError`` that shows the call and how to pass targets, while a
``TypeError`` raised inside a forward that took its arguments stays the model's own; ``WithTargets``
calls the model on the inputs alone; and torch's own ``Adam`` allocates its moments at the first
step (what the engine's ``optimizer_creation`` phase is contrasted with in ``memory.PHASES``).

One 2-rank gloo world then checks the engine itself: the warning on rank 0 only, and not with
``blocks=`` given or for a ``Sequential``; ``(x, y)`` to a ``Sequential`` fails on every rank with
the clear message (stages 0 and 3, no stage-3 hint about block parameters) and leaves the world
usable; ``WithTargets`` training equals single-process ``torch.optim.AdamW`` on the global batch;
``model_creation`` holds no optimizer state and ``optimizer_creation`` holds all of it (8Ψ/N in
fp32, the master being the parameter).

Here: the gloo-world checks of this topic; its other tiers' checks are in
``tests/unit/test_runtime_plain_module.py``.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.plain_models import Plain, data, mlp
from tests.runtime_helpers import rel_err
from tests.worlds import run_world
from zeropp.runtime import BlockChoiceWarning, WithTargets

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS, LR = 2, 1e-2


def mse(out: torch.Tensor, mb: WithTargets) -> torch.Tensor:
    return F.mse_loss(out, mb.targets)


def _engine(model: nn.Module, stage: int, **kw: Any):
    from zeropp.runtime import OptimizerConfig, ZeroConfig, ZeroEngine

    return ZeroEngine(model, config=ZeroConfig(stage=stage), optimizer=OptimizerConfig(lr=LR, weight_decay=0.0), **kw)


def _made(make: Any, **kw: Any) -> tuple[Any, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eng = _engine(make(), 3, **kw)
    return eng, [str(w.message) for w in caught if issubclass(w.category, BlockChoiceWarning)]


def _plain_world(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, make, kw in (("plain", Plain, {}), ("plain_blocks", Plain, {"blocks": nn.Linear}), ("mlp", mlp, {})):
        eng, caught = _made(make, **kw)
        out[name] = {"warnings": caught, "units": [u.name for u in eng.units]}
        eng.close()
    for stage in (0, 3):  # (x, y) handed to a Sequential: one clear error on every rank, the world still usable
        eng = _engine(mlp(), stage, loss_fn=mse)
        try:
            eng.train_step([data(0, rank)])
            out["tuple", stage] = None
        except RuntimeError as e:
            out["tuple", stage] = str(e)
        finally:
            eng.close()
    dist.barrier()
    for stage in (1, 3):  # WithTargets: trained like single-process AdamW on the global batch
        eng = _engine(mlp(), stage, loss_fn=mse)
        try:
            phases = {k: v.tiers for k, v in eng.memory_phases().items()}
            losses = [eng.train_step([WithTargets(*data(s, rank))]).loss for s in range(STEPS)]
            out["train", stage] = {
                "losses": losses,
                "phases": phases,
                "optim_nbytes": eng.optim.nbytes(),
                "weights": {k: v.numpy() for k, v in eng.consolidated_state_dict().items()},
            }
        finally:
            eng.close()
    return out


def _reference(world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    m = mlp()
    opt = torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.0, foreach=False)
    losses = []
    for s in range(STEPS):
        opt.zero_grad()
        parts = [data(s, r) for r in range(world)]
        loss = F.mse_loss(m(torch.cat([p[0] for p in parts])), torch.cat([p[1] for p in parts]))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in m.state_dict().items()}


def test_plain_mlp_through_the_engine() -> None:
    world = 2
    res = run_world(_plain_world, world, timeout=120)
    r0, r1 = res
    # the warning: rank 0 only, naming blocks=; not with blocks given, not for a Sequential
    assert len(r0["plain"]["warnings"]) == 1 and "blocks=" in r0["plain"]["warnings"][0], r0["plain"]
    assert r0["plain"]["units"] == ["root"] and r1["plain"]["warnings"] == []
    assert r0["plain_blocks"] == {"warnings": [], "units": ["block0", "block1", "block2"]}
    assert r0["mlp"] == {"warnings": [], "units": ["block0", "block1", "block2"]}
    for stage in (0, 3):
        msg = r0["tuple", stage]
        assert msg is not None and msg == r1["tuple", stage], (msg, r1["tuple", stage])
        assert "raised on rank(s) [0, 1]" in msg and "ranks 0, 1: MicroBatchError:" in msg, msg
        assert "Sequential(<float32 [4, 8]>, <float32 [4, 8]>)" in msg and "WithTargets" in msg, msg
        assert "registered in one block" not in msg, msg  # stage 3's hint about block parameters does not apply
    ref_losses, ref_w = _reference(world)
    psi = sum(v.numel() for v in ref_w.values())
    for stage in (1, 3):
        t = r0["train", stage]
        assert r1["train", stage]["losses"] == t["losses"]
        for a, b in zip(t["losses"], ref_losses):
            assert abs(a - b) <= 1e-5 * abs(b), (stage, t["losses"], ref_losses)
        flat = torch.cat([torch.as_tensor(t["weights"][k]).reshape(-1) for k in ref_w])
        assert rel_err(flat, torch.cat([v.reshape(-1) for v in ref_w.values()])) <= 1e-5, stage
        # fp32, no offload: the master is the parameter, the optimizer holds m and v of the shard (8Ψ/N)
        ph = t["phases"]
        assert list(ph) == ["model_creation", "optimizer_creation"]  # as constructed, before any step
        assert ph["model_creation"]["device"]["optimizer"] == 0
        assert ph["optimizer_creation"]["device"]["optimizer"] == t["optim_nbytes"] == 8 * psi // world
        assert ph["optimizer_creation"]["device"]["params"] == ph["model_creation"]["device"]["params"]
