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
- ``engine.model.zero_grad()`` (or a torch optimizer's ``zero_grad()``) removed the stand-in
  gradients, and ``clip_grad_norm_`` returned 0 again: it raises as after a step.
- ``engine.model.half()`` / ``.bfloat16()`` / ``.to(torch.float16)`` converted the first
  parameters off the engine's buffers and then raised the clip message: refused before anything
  changes, naming ``ZeroConfig(precision=...)``; ``.to()`` of what the parameters are runs.
- ``engine.eval_loss(batch)`` under ``if rank == 0:`` waited for the group's timeout (30 minutes):
  it now raises within ``call_timeout`` naming the absent rank, the group stays usable, and
  ``eval_loss(..., local=True)`` is this rank's loss alone at stages 0-2 (refused at stage 3). A
  rank that comes after the others gave up raises at once, saying it came late (it waited a second
  ``call_timeout`` and blamed the ranks that gave up). ``save_checkpoint``,
  ``consolidated_state_dict`` and ``load_checkpoint`` likewise, and the roll call's keys of an
  earlier attempt in a store the attempts share (``torchrun --max-restarts``) are not read.
"""

from __future__ import annotations

import datetime
import os
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
    eng.model.zero_grad()  # set to None: the stand-ins are put back
    r["after_zero_grad"] = _error(lambda: torch.nn.utils.clip_grad_norm_(eng.model.parameters(), 1.0))
    opt = torch.optim.SGD(eng.model.parameters(), lr=0.1)  # a DDP loop's leftover optimizer
    opt.zero_grad()
    r["after_opt_zero_grad"] = _error(lambda: torch.nn.utils.clip_grad_norm_(eng.model.parameters(), 1.0))
    opt.zero_grad()
    r["then"] = eng.train_step([mb]).loss  # the engine trains on after each refusal (and optimizer.zero_grad())
    r["eval"] = eng.eval_loss(mb)
    r["convert"] = {
        name: _error(fn)
        for name, fn in (
            ("half", eng.model.half),
            ("bfloat16", eng.model.bfloat16),
            ("to_fp16", lambda: eng.model.to(torch.float16)),
            ("block_double", lambda: eng.model[0].double()),
            ("float", eng.model.float),
            ("to_cpu", lambda: eng.model.to("cpu")),
            ("cpu", eng.model.cpu),
        )
    }
    r["dtypes"] = sorted({str(p.dtype) for p in eng.model.parameters()})
    r["eval_again"] = eng.eval_loss(mb)  # the weights the refusals left as they were
    r["then_again"] = eng.train_step([mb]).loss
    eng.close()
    r["closed_grads"] = [p.grad for p in eng.model.parameters()] if stage < 3 else []
    return r


def _clip_world(rank: int, world: int) -> dict[int, dict[str, Any]]:
    return {stage: _clip_case(rank, stage) for stage in (0, 1, 2, 3)}


@pytest.fixture(scope="module")
def clip_world() -> list[dict[int, dict[str, Any]]]:
    return run_world(_clip_world, 2)


def test_clip_grad_norm_and_backward_outside_train_step_name_grad_clip(clip_world: list) -> None:
    """Also after ``model.zero_grad()`` or a torch optimizer's ``zero_grad()`` (before: clip returned 0)."""
    res = clip_world
    ref = mlp()
    x, y = _global_batch(0, 2)
    F.mse_loss(ref(x), y).backward()
    ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP))
    assert ref_norm > CLIP  # the engine's clip is exercised
    for r in res:
        for stage, got in r.items():
            assert abs(got["norm"] - ref_norm) <= 1e-5 * ref_norm, (stage, got["norm"], ref_norm)
            for call in (
                "before",
                "after",
                "foreach",
                "backward",
                "zero_grad",
                "after_zero_grad",
                "after_opt_zero_grad",
            ):
                msg = got[call]
                assert msg.startswith("RuntimeError: the wrapped model's parameters hold no gradients"), (stage, msg)
                assert "ZeroConfig(grad_clip=...)" in msg and "engine.train_step(micro_batches)" in msg, msg
            assert got["closed_grads"] == [None] * len(got["closed_grads"])  # close(): a plain model again
    assert [r[s]["then"] for r in res for s in r] == [res[0][s]["then"] for _ in res for s in res[0]]


def test_converting_the_wrapped_model_is_refused_before_anything_changes(clip_world: list) -> None:
    """Before: ``.half()`` converted parameters off the engine's buffers, then raised the clip message."""
    for r in clip_world:
        for stage, got in r.items():
            for name in ("half", "bfloat16", "to_fp16", "block_double"):
                msg = got["convert"][name]
                assert msg.startswith("RuntimeError: converting or moving the wrapped model"), (stage, name, msg)
                assert "ZeroConfig(precision='bf16' or 'fp16')" in msg and "nothing was changed" in msg, msg
                assert "by a copy (torch." in msg and "on cpu)" in msg, msg
            assert [got["convert"][n] for n in ("float", "to_cpu", "cpu")] == ["no error"] * 3, (stage, got["convert"])
            assert got["dtypes"] == ["torch.float32"], (stage, got["dtypes"])
            assert got["eval_again"] == got["eval"], (stage, got["eval"], got["eval_again"])
            assert got["then_again"] == clip_world[0][stage]["then_again"], stage


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
    if stage == 3:  # a forward of the model's own: it gathers every block from every rank
        with torch.no_grad():
            if rank == 0:
                r["forward_alone"] = _error(lambda: eng.model(mb.inputs))
            dist.barrier()
            r["forward"] = [eng.model(mb.inputs) for _ in range(2)]  # every rank: pairs up; the second unchecked
    eng.close()
    return r


def _late_case(rank: int) -> dict[str, Any]:
    """Every rank evaluates, but rank 1 comes after rank 0 gave up on it (rank 1 waits for rank 0's
    signal in the store: no collective between, as with slow host work)."""
    from zeropp.runtime import WithTargets

    mb = WithTargets(*data(5, rank))
    eng = _engine(0, call_timeout=datetime.timedelta(seconds=1))
    store = dist.distributed_c10d._get_default_store()
    r: dict[str, Any] = {}
    if rank == 1:
        store.wait(["test/rank0_gave_up"], datetime.timedelta(seconds=60))
    t0 = time.perf_counter()
    r["late"] = _error(lambda: eng.eval_loss(mb))
    r["late_s"] = time.perf_counter() - t0
    if rank == 0:
        store.set("test/rank0_gave_up", "1")
    dist.barrier()
    r["every"] = eng.eval_loss(mb)  # the calls pair up again
    eng.close()
    return r


def _eval_world(rank: int, world: int) -> dict[Any, dict[str, Any]]:
    return {**{stage: _eval_case(rank, stage) for stage in (0, 1, 2, 3)}, "late": _late_case(rank)}


def test_eval_loss_on_one_rank_fails_fast_or_runs_locally() -> None:
    res = run_world(_eval_world, 2, timeout=120)
    late = [r.pop("late") for r in res]
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
    # before: a stage-3 forward on rank 0 alone waited in its first gather for the group's timeout
    alone = res[0][3]["forward_alone"]
    assert alone.startswith("RuntimeError: engine.model's forward (outside train_step and eval_loss; at stage 3"), alone
    assert "but rank(s) [1] did not call it within 1 s" in alone, alone
    for rank, r in enumerate(res):
        with torch.no_grad():
            want = ref(data(5, rank)[0])
        assert all(torch.allclose(out, want, rtol=1e-5, atol=1e-6) for out in r[3]["forward"]), rank
    assert late[0]["late"].startswith("RuntimeError: eval_loss is collective, but rank(s) [1] did not call it"), late
    msg = late[1]["late"]  # before: it waited another call_timeout, then named rank 0 as absent
    assert msg.startswith("RuntimeError: eval_loss is collective, and this rank came to it late: rank(s) [0]"), msg
    assert "waited call_timeout=1 s for it and gave up" in msg and "ZeroEngine(call_timeout=...)" in msg, msg
    assert late[1]["late_s"] < 20, late[1]["late_s"]
    assert all(abs(r["every"] - every) <= 1e-6 * every for r in late), late


def _save_case(rank: int, stage: int, root: str) -> dict[str, Any]:
    eng = _engine(stage, call_timeout=datetime.timedelta(seconds=1))
    r: dict[str, Any] = {}
    if rank == 0:  # a DDP script's save and export on rank 0 only
        t0 = time.perf_counter()
        r["save"] = _error(lambda: eng.save_checkpoint(f"{root}/alone{stage}"))
        r["weights"] = _error(eng.consolidated_state_dict)
        r["alone_s"] = time.perf_counter() - t0
    dist.barrier()  # the group is still in step
    r["saved"] = Path(eng.save_checkpoint(f"{root}/every{stage}", extra={"step": 7})).name  # the calls pair up again
    r["full"] = {k: v.clone() for k, v in eng.consolidated_state_dict().items()}
    if rank == 0:  # a DDP script's resume on rank 0 only
        t0 = time.perf_counter()
        r["load"] = _error(lambda: eng.load_checkpoint(f"{root}/every{stage}"))
        r["load_s"] = time.perf_counter() - t0
    dist.barrier()
    r["loaded"] = eng.load_checkpoint(f"{root}/every{stage}")  # every rank: pairs up
    eng.close()
    return r


def _save_world(rank: int, world: int, root: str) -> dict[int, dict[str, Any]]:
    return {stage: _save_case(rank, stage, root) for stage in (0, 3)}


def test_save_export_and_load_on_one_rank_fail_fast_and_write_nothing(tmp_path: Path) -> None:
    """Before: ``if rank == 0: engine.save_checkpoint(...)`` (or ``consolidated_state_dict()``,
    ``load_checkpoint``) waited in the first collective for the process group's timeout."""
    res = run_world(_save_world, 2, tmp_path, timeout=120)
    ref = mlp().state_dict()
    for stage, got in res[0].items():
        for key, what in (("save", "save_checkpoint"), ("weights", "consolidated_state_dict")):
            assert got[key].startswith(f"RuntimeError: {what} is collective, but rank(s) [1] did not call it"), got
        assert got["alone_s"] < 20, got["alone_s"]
        assert not (tmp_path / f"alone{stage}").exists()  # nothing written
        # before: the load waited in its first collective for the process group's timeout
        assert got["load"].startswith("RuntimeError: load_checkpoint is collective, but rank(s) [1] did not call"), got
        assert got["load_s"] < 20, got["load_s"]
    for r in res:
        for stage, got in r.items():
            assert got["loaded"] == {"step": 7}, got["loaded"]
            assert (tmp_path / f"every{stage}" / got["saved"]).is_dir()
            assert got["full"].keys() == ref.keys() and all(torch.equal(got["full"][k], ref[k]) for k in ref), stage


def _attempt(rank: int, world: int, port: int, attempt: int) -> dict[str, Any]:
    """One attempt of a job restarted by torchrun: its ranks rendezvous through the agent's store,
    shared by every attempt, as ``TORCHELASTIC_USE_AGENT_STORE`` workers do."""
    from zeropp.runtime import WithTargets

    dist.destroy_process_group()  # the launcher's own group: this attempt's is on the shared store
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_RESTART_COUNT=str(attempt),
    )
    dist.init_process_group(
        "gloo", init_method="env://", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30)
    )
    mb = WithTargets(*data(5, rank))
    eng = _engine(0, call_timeout=datetime.timedelta(seconds=1))
    r: dict[str, Any] = {}
    if attempt == 1 and rank == 0:
        r["alone"] = _error(lambda: eng.eval_loss(mb))
    if attempt == 1:
        dist.barrier()
    r["every"] = eng.eval_loss(mb)  # attempt 0: its roll call's keys stay in the store (the attempt ends here)
    if attempt == 0:
        # gloo's own address keys would stay too, and the next attempt could connect to this one's
        # closed ports (a race of torch's, not the engine's): removed, the roll call's keys kept
        dist.barrier()
        store = dist.distributed_c10d._get_default_store()
        gloo_keys = [f"cpu//0/{r}" for r in range(world)]
        r["gloo_keys"] = store.check(gloo_keys)
        dist.barrier()
        if rank == 0:
            for key in gloo_keys:
                store.delete_key(key)
    return r


def test_a_restarted_attempt_does_not_read_the_roll_calls_of_the_attempt_before() -> None:
    """Before: the keys were named by the engine's order in its process, the same in every attempt,
    so the first attempt's ``go`` let the second attempt's rank 0 into the collective alone."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the agent's, kept across attempts
    first = run_world(_attempt, 2, store.port, 0, timeout=60)
    second = run_world(_attempt, 2, store.port, 1, timeout=60)
    ref = mlp()
    with torch.no_grad():
        x, y = _global_batch(5, 2)
        every = float(F.mse_loss(ref(x), y))
    assert first[0]["gloo_keys"], "torch keeps gloo's addresses elsewhere now: update the keys removed above"
    assert second[0]["alone"].startswith("RuntimeError: eval_loss is collective, but rank(s) [1] did not call it")
    assert all(abs(r["every"] - every) <= 1e-6 * every for r in first + second), (first, second)


def _calls_in_a_row(rank: int, world: int) -> dict[str, Any]:
    """Roll calls that go ahead with no collective between them (a call that then raises alike on
    every rank before sending anything, called again); rank 1 slowed down now and then."""
    from zeropp.runtime.rollcall import roll_calls

    check = roll_calls(["save_checkpoint"], timeout=datetime.timedelta(seconds=10), device=torch.device("cpu"))
    roll_call = check["save_checkpoint"]
    assert roll_call is not None
    store = dist.distributed_c10d._get_default_store()
    dist.barrier()
    keys = store.num_keys()
    errors = []
    for i in range(60):
        if rank == 1 and i % 3 == 0:
            time.sleep(0.01)
        try:
            roll_call.check()
        except RuntimeError as e:
            errors.append(f"call {i}: {e}")
            break
    dist.barrier()
    return {"errors": errors, "keys_left": store.num_keys() - keys}


def test_roll_calls_that_go_ahead_without_a_collective_between_them_all_go_ahead() -> None:
    """Before: rank 0's next call removed the last call's keys, the verdict too, while a slower rank
    could still be reading it; that rank then waited ``call_timeout`` for it and raised."""
    res = run_world(_calls_in_a_row, 2, timeout=120)
    assert [r["errors"] for r in res] == [[], []], res
    assert res[0]["keys_left"] <= 3 * 6, res  # the keys of the last few calls only (6 keys a call at world 2)
