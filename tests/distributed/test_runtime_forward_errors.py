"""A forward (or loss) that raises on one rank only, at stages 0-2: every rank raises the same
error right after the forward (no rank waits in a collective until the timeout), in training and
evaluation, and the world is usable afterwards. (Stage 3's own check: tests/distributed/test_runtime_wrap.py.)

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
    for stage in (0, 1, 2):
        torch.manual_seed(0)
        eng = ZeroEngine(_Flaky(TINY), config=ZeroConfig(stage=stage, grad_accum_steps=2))
        try:
            batches = [micro_batch(0, j, rank, TINY) for j in range(2)]
            eng.model.fail = True
            for what, call in (
                ("train", lambda: eng.train_step(batches)),  # noqa: B023 (called in this iteration)
                ("eval", lambda: eng.eval_loss(*batches[0])),  # noqa: B023
            ):
                try:
                    call()
                    out[stage, what] = None
                except RuntimeError as e:
                    out[stage, what] = (str(e), type(e.__cause__).__name__ if e.__cause__ else None)
            eng.model.fail = False
            out[stage, "after"] = eng.train_step(batches).loss  # the engine and the world still work
        finally:
            eng.close()
        torch.manual_seed(0)
        ref = ZeroEngine(_Flaky(TINY), config=ZeroConfig(stage=stage, grad_accum_steps=2))
        try:  # the failed step left no trace: the same loss as a fresh engine's first step
            out[stage, "fresh"] = ref.train_step([micro_batch(0, j, rank, TINY) for j in range(2)]).loss
        finally:
            ref.close()
    dist.barrier()
    return out


def test_one_ranks_forward_error_is_raised_on_every_rank_at_stages_0_to_2() -> None:
    res = run_world(_world, 2, timeout=120)
    for stage in (0, 1, 2):
        for what in ("train", "eval"):
            msgs = [r[stage, what] for r in res]
            assert all(m is not None for m in msgs), (stage, what, msgs)
            assert msgs[0][0] == msgs[1][0]  # the same message everywhere
            assert "raised on rank(s) [1]" in msgs[0][0] and "rank 1: ValueError: bad batch on this rank" in msgs[0][0]
            assert msgs[1][1] == "ValueError" and msgs[0][1] is None  # chained to the rank's own error
        assert res[0][stage, "after"] == res[1][stage, "after"] == res[0][stage, "fresh"]
