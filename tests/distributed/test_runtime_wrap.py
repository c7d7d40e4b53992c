"""Wrapping any ``nn.Module``: block policies, any micro-batch and output form, and the errors.

A toy regression model that is not the GPT (no ``blocks`` ModuleList, awkward sizes 7 -> 17 -> 5,
blocks returning dicts) is trained by ZeroEngine at stages 0-3 on 2 gloo ranks and compared with
single-process training on the global batch (``torch.optim.AdamW`` + ``clip_grad_norm_``), to the
tolerance of ``test_runtime_parity``, in three forms:

- ``dict``: dict micro-batches (``model(**mb)``), the model returns ``{"pred": ...}`` and the loss is
  the trainer's ``loss_fn(output, mb)``; blocks chosen by class list;
- ``attr``: dict micro-batches, the model returns a plain dataclass with a ``loss`` attribute (which
  ``torch.utils._pytree`` cannot flatten: stage 3 gathers the root before backward itself); blocks
  chosen by a ``callable(name, module)``;
- ``scalar``: tuple micro-batches (``model(*mb)``), the model returns the scalar loss; blocks by one class.

Errors, each raised identically on every rank, with the world still usable afterwards (no hang):
a block policy that matches nothing; at stage 3 a block that uses another block's parameter (on
every rank, and on one rank only: the case that used to leave the other ranks waiting); blocks
that run in another order than the policy lists them (their gradients would arrive after the
unit was reduced), caught after forward, and the backstop after backward for such late gradients.

Here: the gloo-world checks of this topic; its other tiers' checks are in ``tests/unit/test_runtime_wrap.py``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests.runtime_helpers import rel_err
from tests.worlds import run_world
from tests.wrap_toy import ResBlock, data, make_toy, mse_of

STEPS, ACCUM, CLIP, LR, WD = 5, 2, 0.05, 1e-2, 0.01
STAGES = (0, 1, 2, 3)
FORMS = ("dict", "attr", "scalar")


POLICY = {"dict": [ResBlock], "attr": lambda name, m: name in ("l0", "l1", "l2"), "scalar": ResBlock}


def batch(form: str, step: int, micro: int, rank: int) -> Any:
    x, y = data(step, micro, rank)
    return (x, y) if form == "scalar" else {"x": x, "y": y}


def reference(world: int) -> tuple[list[float], list[float], dict[str, torch.Tensor], float]:
    model = make_toy("scalar")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, foreach=False)
    losses, norms = [], []
    for s in range(STEPS):
        opt.zero_grad()
        tot = 0.0
        for j in range(ACCUM):
            parts = [data(s, j, r) for r in range(world)]
            loss = model(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
            (loss / ACCUM).backward()
            tot += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        losses.append(tot / ACCUM)
    with torch.no_grad():
        parts = [data(99, 0, r) for r in range(world)]
        ev = float(model(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])))
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}, ev


def _engine(model: nn.Module, world: int, stage: int, **kw: Any):
    from zeropp.comm import Topology
    from zeropp.runtime import OptimizerConfig, ZeroConfig, ZeroEngine

    return ZeroEngine(
        model,
        config=ZeroConfig(stage=stage, grad_accum_steps=ACCUM, grad_clip=CLIP),
        optimizer=OptimizerConfig(lr=LR, weight_decay=WD),
        topology=Topology.single_node(world),
        **kw,
    )


def _toy_world(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for form in FORMS:
        for stage in STAGES:
            eng = _engine(make_toy(form), world, stage, blocks=POLICY[form], loss_fn=mse_of if form == "dict" else None)
            try:
                res = [eng.train_step([batch(form, s, j, rank) for j in range(ACCUM)]) for s in range(STEPS)]
                x, y = data(99, 0, rank)
                ev = eng.eval_loss(x, y) if form == "scalar" else eng.eval_loss({"x": x, "y": y})
                out[form, stage] = {
                    "losses": [r.loss for r in res],
                    "norms": [r.grad_norm for r in res],
                    "eval": ev,
                    "blocks": [u.name for _, u in eng.blocks],
                    "weights": {k: v.numpy() for k, v in eng.consolidated_state_dict().items()},
                }
            finally:
                eng.close()
    return out


def test_any_module_any_batch_matches_single_process_at_every_stage() -> None:
    world = 2
    res = run_world(_toy_world, world, timeout=300)
    ref_losses, ref_norms, ref_w, ref_eval = reference(world)
    assert max(ref_norms) > CLIP, "the test must exercise clipping"
    for form in FORMS:
        for stage in STAGES:
            r = res[0][form, stage]
            assert res[1][form, stage]["losses"] == r["losses"]
            assert r["blocks"] == ["block0", "block1", "block2"], (form, r["blocks"])
            for a, b in zip(r["losses"], ref_losses):
                assert abs(a - b) <= 1e-5 * abs(b), (form, stage, r["losses"], ref_losses)
            for a, b in zip(r["norms"], ref_norms):
                assert abs(a - b) <= 1e-5 * abs(b), (form, stage, r["norms"], ref_norms)
            assert abs(r["eval"] - ref_eval) <= 1e-5 * abs(ref_eval), (form, stage, r["eval"], ref_eval)
            w = r["weights"]
            assert set(w) == set(ref_w)
            flat_got = torch.cat([torch.as_tensor(w[k]).reshape(-1) for k in ref_w])
            flat_ref = torch.cat([ref_w[k].reshape(-1) for k in ref_w])
            assert rel_err(flat_got, flat_ref) <= 1e-5, (form, stage)
            assert max(rel_err(w[k], ref_w[k]) for k in ref_w) <= 2e-4, (form, stage)


def _policy_world(rank: int, world: int) -> list[str]:
    def never(name: str, module: nn.Module) -> bool:
        return False

    msgs = []
    for policy in ([nn.GRU], never):
        try:
            _engine(make_toy(), world, 3, blocks=policy)
            msgs.append("no error")
        except ValueError as e:
            msgs.append(str(e))
    dist.barrier()  # the world is still usable
    return msgs


def test_a_policy_that_matches_nothing_fails_alike_on_every_rank() -> None:
    res = run_world(_policy_world, 2, timeout=60)
    assert res[0] == res[1]
    gru, never = res[0]
    assert "blocks=[GRU] matches no submodule of Toy" in gru, gru
    assert "never" in never and "matches no submodule" in never, never


def _misuse_world(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case in ("all", "rank1"):
        for stage in (2, 3):
            m = make_toy("scalar")
            if case == "all" or rank == 1:
                m.l1.borrow = [m.l0.lin]  # block 1 uses block 0's weight, registered only in block 0
            eng = _engine(m, world, stage, blocks=ResBlock)
            try:
                eng.train_step([batch("scalar", 0, j, rank) for j in range(ACCUM)])
                out[case, stage] = None
            except RuntimeError as e:
                out[case, stage] = str(e)
            try:  # evaluation too: the same agreement, the engine still usable after the error
                eng.eval_loss(*data(9, 0, rank))
                out[case, stage, "eval"] = None
            except RuntimeError as e:
                out[case, stage, "eval"] = str(e)
            finally:
                eng.close()
    # blocks run in forward in the reverse of the policy's (registration) order; "late": the same with
    # stage 3's forward check switched off, so that the backstop after backward must catch it (the
    # gradients of blocks 2 and 1 arrive after their units were flushed)
    for case, stage in (("order", 2), ("order", 3), ("late", 3)):
        eng = _engine(make_toy("scalar", order=(2, 1, 0)), world, stage, blocks=ResBlock)
        if case == "late":
            eng.stage3.check_forward = lambda error=None, defer=False: None
        before = [eng.update.master_copy(i) for i in range(len(eng.units))]  # this rank's fp32 masters
        try:
            eng.train_step([batch("scalar", 0, j, rank) for j in range(ACCUM)])
            out[case, stage] = None
        except RuntimeError as e:
            out[case, stage] = str(e)
        finally:
            # whether an update was made: the masters differ from what they were before the step
            out[case, stage, "updated"] = [not torch.equal(m, eng.update.master_copy(i)) for i, m in enumerate(before)]
            eng.close()
    dist.barrier()  # every rank got here: nobody is left waiting in a collective
    return out


def test_a_parameter_used_in_another_block_fails_alike_on_every_rank() -> None:
    res = run_world(_misuse_world, 2, timeout=120)
    assert res[0] == res[1]  # the same outcome and the same message on both ranks
    r = res[0]
    assert r["rank1", 2] is None  # stage 2: every parameter is present, the use is just a use
    for case, ranks in (("all", "[0, 1]"), ("rank1", "[1]")):
        msg = r[case, 3]
        assert msg is not None, case
        assert f"raised on rank(s) {ranks}" in msg and "inside block1" in msg, msg
        assert "register it in the block that uses it" in msg, msg
        assert r[case, 3, "eval"] is not None and f"raised on rank(s) {ranks}" in r[case, 3, "eval"]
        assert r[case, 2, "eval"] is None
    assert r["order", 2] is None  # stage 2 reduces in one fixed order whatever the forward did
    msg = r["order", 3]
    assert msg is not None and "in the order the block policy lists them" in msg, msg
    assert "rank 0: block1 ran after block2" in msg and "rank 1: block1 ran after block2" in msg, msg
    msg = r["late", 3]
    assert msg is not None and "arrived after their unit's gradient was sent" in msg and "no step was taken" in msg, msg
    assert not any(r["late", 3, "updated"])  # the error came before the optimizer touched anything
    assert any(r["order", 2, "updated"])  # (the reference: a step that went through updated the masters)
    assert "rank 0:" in msg and "rank 1:" in msg and "(block2)" in msg, msg
