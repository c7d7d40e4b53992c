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
