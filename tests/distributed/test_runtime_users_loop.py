"""A DDP loop ported onto ``ZeroEngine``, on 2-rank gloo worlds: the calls that used to go silently
wrong or wait for the process group's timeout, each now right or one clear error.

- ``torch.nn.utils.clip_grad_norm_(engine.model.parameters(), 1.0)`` after a step returned 0 and
  clipped nothing (the gradients live in the engine's shards), and ``loss.backward()`` outside
  ``train_step`` trained nothing: both raise, naming ``ZeroConfig.grad_clip``, at stages 0-3; the
  engine's own clip gives the norm plain torch's ``clip_grad_norm_`` gives on the global batch.
- ``torch.distributed.checkpoint.load`` into ``engine.model`` (through ``load_state_dict``, or in
  place into ``engine.model.state_dict()``) at stages 0-2 changed the parameters but not the
  engine's masters; the next step overwrote it or trained from a mix. Now ``train_step`` refuses
  on every rank (also when one rank alone wrote), naming
  ``engine.load_checkpoint``, until ``engine.refresh_params()``; plain ``load_state_dict`` is
  refused before it writes anything.
- ``engine.eval_loss(batch)`` under ``if rank == 0:`` waited for the group's timeout (30 minutes):
  it now raises within ``call_timeout`` naming the absent rank, the group stays usable, and
  ``eval_loss(..., local=True)`` is this rank's loss alone at stages 0-2 (refused at stage 3).
"""

from __future__ import annotations

import datetime
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.plain_models import data, mlp
from tests.runtime_helpers import outcome as _error
from tests.worlds import run_world

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CLIP = 0.05


def _engine(stage: int, **kw: Any) -> Any:
    from zeropp.runtime import ZeroConfig, ZeroEngine

    timeout = kw.pop("call_timeout", datetime.timedelta(seconds=60))
    return ZeroEngine(
        mlp(),
        config=ZeroConfig(stage=stage, **kw),
        loss_fn=lambda out, mb: F.mse_loss(out, mb.targets),
        call_timeout=timeout,
    )


def _global_batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [data(step, r) for r in range(world)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _clip_case(rank: int, stage: int) -> dict[str, Any]:
    from zeropp.runtime import WithTargets

    eng = _engine(stage, grad_clip=CLIP)
    mb = WithTargets(*data(0, rank))
    r = {"before": _error(lambda: torch.nn.utils.clip_grad_norm_(eng.model.parameters(), 1.0))}
    r["norm"] = eng.train_step([mb]).grad_norm
    r["after"] = _error(lambda: torch.nn.utils.clip_grad_norm_(eng.model.parameters(), 1.0))
    r["foreach"] = _error(lambda: torch.nn.utils.clip_grad_norm_(eng.model.parameters(), 1.0, foreach=False))
    r["backward"] = _error(lambda: F.mse_loss(eng.model(mb.inputs), mb.targets).backward())
    r["zero_grad"] = _error(lambda: eng.model.zero_grad(set_to_none=False))
    r["then"] = eng.train_step([mb]).loss  # the engine trains on after each refusal
    eng.close()
    r["closed_grads"] = [p.grad for p in eng.model.parameters()] if stage < 3 else []
    return r


def _clip_world(rank: int, world: int) -> dict[int, dict[str, Any]]:
    return {stage: _clip_case(rank, stage) for stage in (0, 1, 2, 3)}


def test_clip_grad_norm_and_backward_outside_train_step_name_grad_clip() -> None:
    res = run_world(_clip_world, 2)
    ref = mlp()
    x, y = _global_batch(0, 2)
    F.mse_loss(ref(x), y).backward()
    ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP))
    assert ref_norm > CLIP  # the engine's clip is exercised
    for r in res:
        for stage, got in r.items():
            assert abs(got["norm"] - ref_norm) <= 1e-5 * ref_norm, (stage, got["norm"], ref_norm)
            for call in ("before", "after", "foreach", "backward", "zero_grad"):
                msg = got[call]
                assert msg.startswith("RuntimeError: the wrapped model's parameters hold no gradients"), (stage, msg)
                assert "ZeroConfig(grad_clip=...)" in msg and "engine.train_step(micro_batches)" in msg, msg
            assert got["closed_grads"] == [None] * len(got["closed_grads"])  # close(): a plain model again
    assert [r[s]["then"] for r in res for s in r] == [res[0][s]["then"] for _ in res for s in res[0]]


def _written_case(rank: int, stage: int, ckpt: str, other: dict[str, torch.Tensor]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from zeropp.runtime import WithTargets

    mb = WithTargets(*data(0, rank))
    eng = _engine(stage)
    before = eng.consolidated_state_dict()
    r = {"plain": _error(lambda: eng.model.load_state_dict(other))}
    r["plain_unchanged"] = all(torch.equal(v, before[k]) for k, v in eng.consolidated_state_dict().items())
    r["plain_then"] = _error(lambda: eng.train_step([mb]))  # nothing was written: training goes on
    r["stateful"] = _error(lambda: dcp.load({"model": eng.model}, checkpoint_id=ckpt))
    r["stateful_step"] = _error(lambda: eng.train_step([mb]))
    r["stateful_eval"] = eng.eval_loss(mb)  # evaluates what was loaded (a user's right: EMA weights)
    r["stateful_step_again"] = _error(lambda: eng.train_step([mb]))  # the evaluation settled nothing
    eng.refresh_params()
    r["refreshed"] = _error(lambda: eng.train_step([mb]))
    dcp.load({"model": eng.model.state_dict()}, checkpoint_id=ckpt)  # in place, no load_state_dict
    r["in_place_step"] = _error(lambda: eng.train_step([mb]))
    eng.refresh_params()
    if rank == 1:  # one rank alone: refused on both
        with torch.no_grad():
            next(eng.model.parameters()).add_(1.0)
    r["one_rank_step"] = _error(lambda: eng.train_step([mb]))
    eng.refresh_params()
    first = next(eng.model.parameters())

    def clamp(module: torch.nn.Module, args: Any) -> None:  # a model that bounds its own parameter
        with torch.no_grad():
            first.clamp_(-10.0, 10.0)

    hook = eng.model.register_forward_pre_hook(clamp)
    r["own_writes"] = [_error(lambda: eng.train_step([mb])), _error(lambda: eng.eval_loss(mb))]
    r["own_writes"].append(_error(lambda: eng.train_step([mb])))
    hook.remove()
    r["end"] = eng.train_step([mb]).loss
    eng.close()
    return r


def _written_world(rank: int, world: int, ckpt: str) -> dict[int, dict[str, Any]]:
    import torch.distributed.checkpoint as dcp

    other = {k: torch.full_like(v, 0.5) for k, v in mlp().state_dict().items()}
    dcp.save({"model": other}, checkpoint_id=ckpt)
    return {stage: _written_case(rank, stage, ckpt, other) for stage in (0, 1, 2)}


def test_writes_into_the_wrapped_models_parameters_are_refused_on_every_rank(tmp_path: Path) -> None:
    res = run_world(_written_world, 2, str(tmp_path / "dcp"))
    for r in res:
        for stage, got in r.items():
            for call in ("plain", "stateful"):
                assert got[call].startswith(
                    f"RuntimeError: model.load_state_dict() on a model ZeroEngine wraps (stage {stage})"
                ), got[call]
                assert "engine.load_checkpoint(path)" in got[call]
            assert "has already written" not in got["plain"] and "has already written" in got["stateful"]
            assert got["plain_unchanged"] and got["plain_then"] == "no error" and got["refreshed"] == "no error"
            loaded = mlp()
            loaded.load_state_dict({k: torch.full_like(v, 0.5) for k, v in loaded.state_dict().items()})
            x, y = _global_batch(0, 2)
            with torch.no_grad():
                want = float(F.mse_loss(loaded(x), y))
                assert abs(got["stateful_eval"] - want) <= 1e-6 * want, (stage, got["stateful_eval"], want)
            assert got["own_writes"] == ["no error"] * 3, (stage, got["own_writes"])
            for call in ("stateful_step", "stateful_step_again", "in_place_step", "one_rank_step"):
                msg = got[call]
                assert "were written in place outside ZeroEngine" in msg, (stage, call, msg)
                assert "engine.load_checkpoint(path)" in msg and "engine.refresh_params()" in msg, msg
                assert f"raised on rank(s) {[1] if call == 'one_rank_step' else [0, 1]}" in msg, msg
    assert [r[s]["end"] for r in res for s in r] == [res[0][s]["end"] for _ in res for s in res[0]]


def _eval_case(rank: int, stage: int) -> dict[str, Any]:
    from zeropp.runtime import WithTargets

    mb = WithTargets(*data(5, rank))
    eng = _engine(stage, call_timeout=datetime.timedelta(seconds=1))
    r: dict[str, Any] = {}
    if rank == 0:  # a DDP script's evaluation on rank 0 only
        t0 = time.perf_counter()
        r["alone"] = _error(lambda: eng.eval_loss(mb))
        r["alone_s"] = time.perf_counter() - t0
        try:
            r["local"] = eng.eval_loss(mb, local=True)
        except ValueError as e:
            r["local"] = f"ValueError: {e}"
    dist.barrier()  # the group is still in step
    r["every"] = eng.eval_loss(mb)  # every rank: the calls pair up again
    r["again"] = eng.eval_loss(mb)
    eng.close()
    return r


def _eval_world(rank: int, world: int) -> dict[int, dict[str, Any]]:
    return {stage: _eval_case(rank, stage) for stage in (0, 1, 2, 3)}


def test_eval_loss_on_one_rank_fails_fast_or_runs_locally() -> None:
    res = run_world(_eval_world, 2, timeout=120)
    ref = mlp()
    with torch.no_grad():
        x, y = _global_batch(5, 2)
        every = float(F.mse_loss(ref(x), y))
        local = float(F.mse_loss(ref(data(5, 0)[0]), data(5, 0)[1]))
    for stage, got in res[0].items():
        assert got["alone"].startswith("RuntimeError: eval_loss is collective, but rank(s) [1] did not call it"), got
        assert "called on rank(s) [0]" in got["alone"] and "not under `if rank == 0:`" in got["alone"]
        assert got["alone_s"] < 20, got["alone_s"]
        if stage < 3:
            assert abs(got["local"] - local) <= 1e-6 * local, got
        else:
            assert got["local"].startswith("ValueError: eval_loss(..., local=True) evaluates on this rank alone")
            assert "at stage 3 its forward gathers" in got["local"], got["local"]
    for r in res:
        for stage, got in r.items():
            assert abs(got["every"] - every) <= 1e-6 * every and got["again"] == got["every"], (stage, got, every)


def _save_case(rank: int, stage: int, root: str) -> dict[str, Any]:
    eng = _engine(stage, call_timeout=datetime.timedelta(seconds=1))
    r: dict[str, Any] = {}
    if rank == 0:  # a DDP script's save and export on rank 0 only
        t0 = time.perf_counter()
        r["save"] = _error(lambda: eng.save_checkpoint(f"{root}/alone{stage}"))
        r["weights"] = _error(eng.consolidated_state_dict)
        r["alone_s"] = time.perf_counter() - t0
    dist.barrier()  # the group is still in step
    r["saved"] = Path(eng.save_checkpoint(f"{root}/every{stage}")).name  # every rank: the calls pair up again
    r["full"] = {k: v.clone() for k, v in eng.consolidated_state_dict().items()}
    eng.close()
    return r


def _save_world(rank: int, world: int, root: str) -> dict[int, dict[str, Any]]:
    return {stage: _save_case(rank, stage, root) for stage in (0, 3)}


def test_save_and_export_on_one_rank_fail_fast_and_write_nothing(tmp_path: Path) -> None:
    """Before: ``if rank == 0: engine.save_checkpoint(...)`` (or ``consolidated_state_dict()``)
    waited in the first collective for the process group's timeout."""
    res = run_world(_save_world, 2, tmp_path, timeout=120)
    ref = mlp().state_dict()
    for stage, got in res[0].items():
        for key, what in (("save", "save_checkpoint"), ("weights", "consolidated_state_dict")):
            assert got[key].startswith(f"RuntimeError: {what} is collective, but rank(s) [1] did not call it"), got
        assert got["alone_s"] < 20, got["alone_s"]
        assert not (tmp_path / f"alone{stage}").exists()  # nothing written
    for r in res:
        for stage, got in r.items():
            assert (tmp_path / f"every{stage}" / got["saved"]).is_dir()
            assert got["full"].keys() == ref.keys() and all(torch.equal(got["full"][k], ref[k]) for k in ref), stage
