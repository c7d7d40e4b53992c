"""Stage 3 at world 1 on CUDA under NCCL: the engine's full-precision gathers and reductions are
copies at issue on the compute stream (``EngineComm._alone``, ``host_routes.copy_alone``), with no public collective, no side
stream and no event; the result must be stage 0's bit for bit, as on CPU ranks
(``tests/distributed/test_runtime_local_group.py``). A copy issued on the wrong stream, or a pool
buffer reused before the compute stream read it, would show as a different weight."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import numpy as np
import pytest
import torch

from tests.runtime_helpers import nccl_world, spied_train_engine
from tests.worlds import run_world

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _world(rank: int, world: int, store_path: str) -> dict[str, Any]:
    nccl_world(rank, world, store_path)
    base = dict(grad_accum_steps=2)
    return {
        "stage3": spied_train_engine(rank, world, dict(base, stage=3), 1, device="cuda:0"),
        "stage3_prefetch2": spied_train_engine(rank, world, dict(base, stage=3, prefetch_depth=2), 1, device="cuda:0"),
        "stage0": spied_train_engine(rank, world, dict(base, stage=0), 1, device="cuda:0"),
    }


def test_world_one_stage3_is_stage0_bit_for_bit_on_cuda() -> None:
    with tempfile.TemporaryDirectory() as d:
        (r,) = run_world(_world, 1, os.path.join(d, "store"), timeout=300)
    ref = r["stage0"]
    for key in ("stage3", "stage3_prefetch2"):
        got = r[key]
        assert got["public"] == [], key
        assert got["losses"] == ref["losses"] and got["norms"] == ref["norms"], key
        assert got["weights"].keys() == ref["weights"].keys()
        for name, w in ref["weights"].items():
            assert np.array_equal(got["weights"][name], w), (key, name)
