"""A researcher's own script off the happy path, on 2-rank gloo worlds: what a user's loop does
with ``engine.model`` and the collectives that used to go silently wrong or fail obscurely.

- ``engine.model.state_dict()`` at stage 3 held empty tensors (``torch.distributed.checkpoint``
  saved them so): refused, naming ``consolidated_state_dict`` / ``save_checkpoint``; the engine's
  own ``consolidated_state_dict`` still equals the unwrapped model's weights.
- ``engine.model.load_state_dict(sd)`` wrote into the compute copies only (stage 3: a list of size
  mismatches; stages 0-2: the masters kept the old weights): refused at every stage, nothing changed.
- a parameter added after wrapping was used by the forward and never trained: ``train_step``
  refuses it on every rank, naming it, before any collective; the world stays usable.
- an integer AVG through ``all_reduce`` / the plain ``quantized_reduce_scatter`` failed after the
  exchange with ``result type Float can't be cast ...``: refused on gloo on every rank before any message
  (NCCL averages integers: left to it).
- the DDP hook after ``destroy_process_group`` surfaced as ``Unable to cast <message> to Tensor``.
- ``set_topology`` of a topology of another world was taken, and every later collective refused.

One-process checks of this topic: ``tests/unit/test_library_misuse.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.plain_models import data, mlp
from tests.runtime_helpers import outcome as _error
from tests.worlds import run_world

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _model_world(rank: int, world: int, stage: int) -> dict[str, Any]:
    from zeropp.runtime import WithTargets, ZeroConfig, ZeroEngine

    ref = mlp().state_dict()
    eng = ZeroEngine(mlp(), config=ZeroConfig(stage=stage), loss_fn=lambda out, mb: F.mse_loss(out, mb.targets))
    mb = WithTargets(*data(0, rank))
    out: dict[str, Any] = {"state_dict": _error(eng.model.state_dict)}
    before = eng.consolidated_state_dict()
    out["consolidated_is_the_model"] = all(torch.equal(before[k], v) for k, v in ref.items())
    other = {k: torch.full_like(v, 7.0) for k, v in ref.items()}
    out["load"] = _error(lambda: eng.model.load_state_dict(other))
    after = eng.consolidated_state_dict()
    out["unchanged"] = all(torch.equal(after[k], v) for k, v in before.items())
    eng.model.extra = nn.Linear(8, 8)  # added after wrapping
    out["added"] = _error(lambda: eng.train_step([mb]))
    del eng.model.extra
    out["then"] = eng.train_step([mb]).loss  # the world is still usable
    eng.close()
    return out


@pytest.mark.parametrize("stage", [1, 3])
def test_the_wrapped_models_state_dict_load_and_new_parameters(stage: int) -> None:
    res = run_world(_model_world, 2, stage)
    for r in res:
        if stage == 3:
            assert r["state_dict"].startswith(
                "RuntimeError: model.state_dict() of a model ZeroEngine wraps at stage 3 "
            )
            assert "engine.consolidated_state_dict()" in r["state_dict"]
        else:
            assert r["state_dict"] == "no error"  # stages 0-2: real weights (compute copies)
        assert r["consolidated_is_the_model"] and r["unchanged"]
        assert r["load"].startswith(
            f"RuntimeError: model.load_state_dict() on a model ZeroEngine wraps (stage {stage})"
        )
        assert "before ZeroEngine(model) wraps it, or resume with engine.load_checkpoint(path)" in r["load"]
        assert r["added"].startswith(
            "RuntimeError: the model's parameters changed after ZeroEngine wrapped it (new: 'extra.bias', 'extra.weight')"
        )
    assert res[0]["then"] == res[1]["then"]


def _int_avg_world(rank: int, world: int) -> dict[str, Any]:
    from zeropp.comm import ReduceOp, all_reduce, quantized_all_reduce, quantized_reduce_scatter

    t = torch.arange(4) * (rank + 1)
    out = {
        "all_reduce": _error(lambda: all_reduce(t.clone(), ReduceOp.AVG)),
        "reduce_scatter": _error(lambda: quantized_reduce_scatter(torch.empty(2, dtype=torch.int64), t, ReduceOp.AVG)),
        "all_reduce_q": _error(lambda: quantized_all_reduce(t.clone(), ReduceOp.AVG)),
    }
    s = t.clone()
    all_reduce(s, ReduceOp.SUM)  # the suggested fix works, and the world is still usable
    out["sum"] = s.tolist()
    return out


def test_an_integer_average_is_refused_on_every_rank_before_any_message() -> None:
    for r in run_world(_int_avg_world, 2):
        for what in ("all-reduce", "reduce-scatter"):
            key = "all_reduce" if what == "all-reduce" else "reduce_scatter"
            assert r[key] == (
                f"ValueError: {what} with ReduceOp.AVG of a torch.int64 tensor: its mean is not a torch.int64 "
                "(gloo, the backend of CPU tensors, cannot average integers; NCCL can); reduce with ReduceOp.SUM "
                "and divide, or pass a floating-point tensor"
            )
        assert r["all_reduce_q"].startswith("ValueError: reduce-scatter with ReduceOp.AVG of a torch.int64 tensor")
        assert r["sum"] == [0, 3, 6, 9]


def _ddp_after_destroy_world(rank: int, world: int) -> str:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zeropp.comm import QuantSpec
    from zeropp.comm.ddp import QuantizedAllReduceState, quantized_allreduce_hook

    ddp = DDP(mlp())
    ddp.register_comm_hook(QuantizedAllReduceState(grads=QuantSpec(bits=8)), quantized_allreduce_hook)
    x, _ = data(0, rank)
    ddp(x).sum().backward()
    dist.destroy_process_group()
    return _error(lambda: ddp(x).sum().backward())


def test_the_ddp_hook_after_destroy_process_group_says_what_to_do() -> None:
    for msg in run_world(_ddp_after_destroy_world, 2):
        assert "Unable to cast" not in msg
        assert msg.startswith("RuntimeError: quantized_allreduce_hook: the default process group was destroyed")
        assert "wrap the model in a new DDP and register the hook with a new state" in msg


def _set_topology_world(rank: int, world: int) -> dict[str, Any]:
    from zeropp.comm import Topology, get_topology, quantized_all_gather, set_topology

    out: dict[str, Any] = {"set": _error(lambda: set_topology(Topology(nodes=2, ranks_per_node=2)))}
    out["kept"] = get_topology()
    gathered = torch.empty(2 * world)
    quantized_all_gather(gathered, torch.full((2,), float(rank)))  # the default (one node) still works
    out["gathered"] = gathered.tolist()
    return out


def test_a_default_topology_of_another_world_is_refused_where_it_is_set() -> None:
    """Before: ``set_topology`` took it, and every later collective without ``topology=`` raised."""
    for r in run_world(_set_topology_world, 2):
        assert r["set"] == (
            "ValueError: Topology(nodes=2, ranks_per_node=2, hpz_size=None, tp=1) describes 4 ranks but the process "
            "group has 2; use Topology.from_world(2, ranks_per_node=...)"
        )
        assert r["kept"] is None and r["gathered"] == [0.0, 0.0, 1.0, 1.0]


def _loop_world(rank: int, world: int) -> dict[str, Any]:
    from zeropp.runtime import WithTargets, ZeroConfig, ZeroEngine

    def engine(**kw: Any) -> Any:
        loss = kw.pop("loss", lambda out, mb: F.mse_loss(out, mb.targets))
        return ZeroEngine(mlp(), config=ZeroConfig(stage=3, grad_accum_steps=2, **kw), loss_fn=loss)

    mbs = [WithTargets(*data(j, rank)) for j in range(2)]
    a, b = engine(), engine()
    out: dict[str, Any] = {"same": a.train_step(mbs).loss == b.train_step(iter(mbs)).loss}  # a list, an iterator
    out["tuple"] = _error(lambda: a.train_step(tuple(mbs[:1])))
    out["no_grad_loss"] = _error(lambda: engine(loss=lambda o, mb: F.mse_loss(o, mb.targets).detach()).train_step(mbs))
    bf16 = engine(precision="bf16")
    out["dtype"] = _error(lambda: bf16.train_step(mbs))  # fp32 inputs to bf16 parameters
    out["then"] = a.train_step(mbs).loss  # every refusal left the world usable
    return out


def test_a_users_loop_mistakes_in_train_step_are_one_clear_line() -> None:
    """An iterator of micro-batches was a ``TypeError: object of type ... has no len()``; a loss
    without autograd failed in backward with torch's ``element 0 of tensors does not require
    grad``; a dtype mismatch at stage 3 carried the hint about parameters shared across blocks."""
    res = run_world(_loop_world, 2)
    for r in res:
        assert r["same"]
        assert r["tuple"] == (
            "ValueError: train_step got 1 micro-batches but grad_accum_steps=2; pass a list of exactly 2 "
            "(one micro-batch (x, y) is train_step([(x, y)]))"
        )
        assert "raised on rank(s) [0, 1]" in r["no_grad_loss"]
        assert "ValueError: the loss does not require grad, so backward has nothing" in r["no_grad_loss"]
        assert "must have the same dtype" in r["dtype"] and "register it in the block" not in r["dtype"]
    assert res[0]["then"] == res[1]["then"]


def _ddp_foreign_group_world(rank: int, world: int) -> str:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zeropp.comm import QuantSpec
    from zeropp.comm.ddp import QuantizedAllReduceState, quantized_allreduce_hook

    only0 = dist.new_group([0])
    ddp = DDP(mlp())  # over the whole world, but the hook's state names a group without rank 1
    ddp.register_comm_hook(QuantizedAllReduceState(grads=QuantSpec(bits=8), group=only0), quantized_allreduce_hook)
    x, _ = data(0, rank)
    return _error(lambda: ddp(x).sum().backward())


def test_the_ddp_hook_on_a_rank_outside_its_states_group_says_what_to_pass() -> None:
    """Before: ``RuntimeError: Unable to cast rank 1 is not a member of the all-reduce group [0]; only
    members may call it to Tensor`` (the check ran in the continuation, whose error DDP reads as a value)."""
    ok, outside = run_world(_ddp_foreign_group_world, 2)
    assert ok == "no error"  # rank 0 is the group: it reduces alone
    assert outside == (
        "ValueError: quantized_allreduce_hook: rank 1 is not in QuantizedAllReduceState.group (ranks [0]); pass "
        "the DDP model's own process group, or None for the default group"
    )
