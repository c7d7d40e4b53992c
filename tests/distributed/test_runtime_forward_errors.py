"""A forward (or loss) that raises on one rank only, at every stage: every rank raises the same
error (no rank waits in a collective until the timeout), in training and evaluation, and the world
is usable afterwards. The healthy ranks learn it from the deferred check (``zeropp.runtime.batch``)
at their backward's first collective, and send no gradient before raising. (Stage 3's checks of
block order and skipped blocks: tests/distributed/test_runtime_wrap.py.)
A step abandoned that way after its first micro-step's backward leaves no gradient in the next
step, at every stage.

Here: the gloo-world checks of this topic; its other tiers' checks are in
``tests/unit/test_runtime_forward_errors.py``.
"""

from __future__ import annotations

import traceback
from typing import Any

import torch
import torch.distributed as dist

from tests.runtime_helpers import TINY, micro_batch
from tests.worlds import run_world
from zeropp.models import GPT

CASES: tuple[int | str, ...] = (0, 1, 2, 3, "3k")
"""The stages, and "3k": stage 3 with ``keep_at_turn`` (the first micro-step's forward keeps the root
and the last block gathered into its backward; the failing second forward must leave nothing kept)."""


class _Flaky(GPT):
    """A GPT whose forward raises on the chosen rank while ``fail`` is set."""

    fail = False

    def forward(self, *args: Any, **kw: Any) -> Any:
        if self.fail and dist.get_rank() == 1:
            raise ValueError("bad batch on this rank")
        return super().forward(*args, **kw)


def _world(rank: int, world: int) -> dict[Any, Any]:
    from zeropp.runtime import ZeroConfig, ZeroEngine

    out: dict[Any, Any] = {}
    for stage in CASES:
        zkw = dict(stage=3, keep_at_turn=True) if stage == "3k" else dict(stage=stage)
        torch.manual_seed(0)
        eng = ZeroEngine(_Flaky(TINY), config=ZeroConfig(grad_accum_steps=2, **zkw))
        try:
            batches = [micro_batch(0, j, rank, TINY) for j in range(2)]
            eng.model.fail = True
            for what, call in (
                ("train", lambda: eng.train_step(batches)),  # noqa: B023 (called in this iteration)
                ("eval", lambda: eng.eval_loss(*batches[0])),  # noqa: B023
            ):
                before = eng.comm.stats.calls()
                try:
                    call()
                    out[stage, what] = None
                except RuntimeError as e:
                    out[stage, what] = (str(e), type(e.__cause__).__name__ if e.__cause__ else None)
                    # where this rank learnt it: the deferred verdict (a healthy rank in training) or at once
                    out[stage, what, "deferred"] = "run_deferred" in "".join(traceback.format_tb(e.__traceback__))
                out[stage, what, "buffers in use"] = eng.buffers.in_use  # nothing taken and not given back
                after = eng.comm.stats.calls()
                # gradient collectives issued by the failed call (none may be: a peer would wait in them)
                out[stage, what, "grads sent"] = {
                    k: n - before.get(k, 0) for k, n in after.items() if k.startswith(("grad", "bwd"))
                }
            eng.model.fail = False
            out[stage, "after"] = eng.train_step(batches).loss  # the engine and the world still work
        finally:
            eng.close()
        torch.manual_seed(0)
        ref = ZeroEngine(_Flaky(TINY), config=ZeroConfig(grad_accum_steps=2, **zkw))
        try:  # the failed step left no trace: the same loss as a fresh engine's first step
            out[stage, "fresh"] = ref.train_step([micro_batch(0, j, rank, TINY) for j in range(2)]).loss
        finally:
            ref.close()
    dist.barrier()
    return out


def test_one_ranks_forward_error_is_raised_on_every_rank_at_every_stage() -> None:
    res = run_world(_world, 2, timeout=120)
    for stage in CASES:
        for what in ("train", "eval"):
            msgs = [r[stage, what] for r in res]
            assert all(m is not None for m in msgs), (stage, what, msgs)
            assert msgs[0][0] == msgs[1][0]  # the same message everywhere
            assert "raised on rank(s) [1]" in msgs[0][0] and "rank 1: ValueError: bad batch on this rank" in msgs[0][0]
            assert msgs[1][1] == "ValueError" and msgs[0][1] is None  # chained to the rank's own error
            for r in res:
                assert not any(r[stage, what, "grads sent"].values()), (stage, what, r[stage, what, "grads sent"])
                assert r[stage, what, "buffers in use"] == 0, (stage, what)
            # rank 0's forward succeeded: in training it read the verdict at its next collective (or after its
            # backward), not at once; rank 1's failed and waited at once; evaluation never defers
            assert [r[stage, what, "deferred"] for r in res] == [what == "train", False], (stage, what)
        assert res[0][stage, "after"] == res[1][stage, "after"] == res[0][stage, "fresh"]


class _FailsSecond(GPT):
    """A GPT whose second forward call raises on rank 1 while ``armed``: the first micro-step's
    backward has run (and, at stages 2-3, reduced its gradient) when the step is abandoned."""

    armed = False
    calls = 0

    def forward(self, *args: Any, **kw: Any) -> Any:
        self.calls += 1
        if self.armed and self.calls == 2 and dist.get_rank() == 1:
            raise ValueError("bad second micro-batch on this rank")
        return super().forward(*args, **kw)


def _abandoned_world(rank: int, world: int) -> dict[Any, Any]:
    from zeropp.runtime import ZeroConfig, ZeroEngine

    out: dict[Any, Any] = {}
    batches = [micro_batch(0, j, rank, TINY) for j in range(2)]
    for stage in CASES:
        zkw = dict(stage=3, keep_at_turn=True) if stage == "3k" else dict(stage=stage)
        runs = []
        for abandon in (True, False):
            torch.manual_seed(0)
            eng = ZeroEngine(_FailsSecond(TINY), config=ZeroConfig(grad_accum_steps=2, **zkw))
            try:
                if abandon:
                    eng.model.armed = True
                    try:
                        eng.train_step(batches)
                        out[stage, "raised"] = False
                    except RuntimeError:
                        out[stage, "raised"] = True
                    eng.model.armed = False
                res = eng.train_step(batches)
                runs.append((res.loss, res.grad_norm, eng.consolidated_state_dict()))
            finally:
                eng.close()
        (loss, norm, w), (ref_loss, ref_norm, ref_w) = runs
        out[stage] = (loss == ref_loss, norm == ref_norm, all(torch.equal(w[k], ref_w[k]) for k in ref_w), norm)
    dist.barrier()
    return out


def test_a_step_abandoned_after_its_first_backward_leaves_nothing_in_the_next_step() -> None:
    """A forward raising in the second micro-step, after the first one's backward: the next step's
    gradient norm and update are exactly a fresh engine's, at every stage (the first backward's
    gradient is not carried into it)."""
    res = run_world(_abandoned_world, 2, timeout=120)
    for r in res:
        for stage in CASES:
            assert r[stage, "raised"], stage
            assert r[stage][:3] == (True, True, True), (stage, r[stage])


class _BackwardFails(torch.autograd.Function):
    """Identity forward; its backward raises (a rank's own backward error)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("backward failed on this rank")


class _TwoFaults(GPT):
    """Rank 1's forward raises; rank 0's forward succeeds but its backward raises before any collective."""

    def forward(self, *args: Any, **kw: Any) -> Any:
        if dist.get_rank() == 1:
            raise ValueError("bad batch on this rank")
        logits, loss = super().forward(*args, **kw)
        return logits, _BackwardFails.apply(loss)


def _two_faults_world(rank: int, world: int) -> dict[Any, Any]:
    from zeropp.runtime import ZeroConfig, ZeroEngine

    out: dict[Any, Any] = {}
    for stage in (0, 2, 3):
        torch.manual_seed(0)
        eng = ZeroEngine(_TwoFaults(TINY), config=ZeroConfig(stage=stage))
        try:
            eng.train_step([micro_batch(0, 0, rank, TINY)])
            out[stage] = None
        except (RuntimeError, ValueError) as e:
            out[stage] = (type(e).__name__, str(e), type(e.__cause__).__name__ if e.__cause__ else None)
        finally:
            eng.close()
    dist.barrier()  # both ranks got here: nobody is left waiting in the verdict's exchange
    return out


def test_a_backward_error_beside_a_peers_forward_error_raises_the_peers_error_everywhere() -> None:
    """Two faults in one step: rank 1's forward raises while rank 0's backward raises its own error before
    reading the deferred verdict. Rank 0 still reads it (rank 1 waits for it in the verdict's exchange), so
    both raise the error naming rank 1, rank 0's chained to its backward error, and nothing hangs."""
    res = run_world(_two_faults_world, 2, timeout=120)
    # rank 0's cause: its backward's error; at stage 3 the root's gather before backward reads the verdict first
    rank0_cause = {0: "ValueError", 2: "ValueError", 3: None}
    for stage, cause in rank0_cause.items():
        (name0, msg0, cause0), (name1, msg1, cause1) = res[0][stage], res[1][stage]
        assert name0 == name1 == "RuntimeError" and msg0 == msg1 and "raised on rank(s) [1]" in msg0, (stage, res)
        assert (cause0, cause1) == (cause, "ValueError"), (stage, res)  # rank 1: its forward's error
