"""Stage 3's full-precision gathers and reductions over a group of one rank (world 1, hpZ groups of
one) are a copy at issue in the engine itself (``EngineComm._alone``, ``host_routes.copy_alone``): no call of the public
collectives, the same call counts per kind as a world of two, and the same bits as the replicated
stage 0. A quantized gather keeps the codec's rounding, so it still goes through the public
collective; so does an hpZ engine's world gather when only its hpZ group is of one rank.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tests.runtime_helpers import spied_train_engine
from tests.worlds import run_world
from zeropp.comm.spec import QuantSpec


def _alone(rank: int, world: int) -> dict[str, Any]:
    base = dict(grad_accum_steps=2)
    return {
        "stage3": spied_train_engine(rank, world, dict(base, stage=3), 1),
        "stage0": spied_train_engine(rank, world, dict(base, stage=0), 1),
        "qwz": spied_train_engine(rank, world, dict(base, stage=3, weights=QuantSpec(bits=8)), 1),
    }


def _pair(rank: int, world: int) -> dict[str, Any]:
    return {
        "stage3": spied_train_engine(rank, world, dict(stage=3, grad_accum_steps=2), 1),
        "hpz": spied_train_engine(
            rank, world, dict(stage=3, grad_accum_steps=2, hpz=True), 2
        ),  # 2 nodes of 1: hpZ groups of one
        "plain": spied_train_engine(rank, world, dict(stage=3, grad_accum_steps=2), 2),
    }


def _same_weights(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Bit for bit (the weights come back as numpy arrays)."""
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


def test_world_one_gathers_and_reductions_are_local_and_exact() -> None:
    (alone,) = run_world(_alone, 1)
    pair = run_world(_pair, 2)
    s3 = alone["stage3"]
    assert s3["public"] == []  # not one public collective at world 1
    assert s3["calls"] == pair[0]["stage3"]["calls"]  # counted as a world of two counts them
    assert {"fwd_all_gather", "bwd_all_gather", "grad_reduce_scatter"} <= {k for k, n in s3["calls"].items() if n > 0}
    assert s3["losses"] == alone["stage0"]["losses"] and s3["norms"] == alone["stage0"]["norms"]
    assert _same_weights(s3["weights"], alone["stage0"]["weights"])
    qwz = alone["qwz"]  # INT8 weights: the gathers round through the codec even alone
    assert {k for n, k in qwz["public"]} == {"fwd_all_gather", "bwd_all_gather"}
    assert qwz["losses"] != s3["losses"]


def test_hpz_groups_of_one_gather_locally_inside_the_node() -> None:
    for r in run_world(_pair, 2):
        hpz, plain = r["hpz"], r["plain"]
        # the world gathers and reductions communicate (the final consolidation's gathers too); the
        # backward gathers from the secondary do not
        assert {k for n, k in hpz["public"]} == {"fwd_all_gather", "grad_reduce_scatter", "checkpoint"}
        assert "bwd_all_gather" in {k for n, k in plain["public"]}
        assert hpz["calls"] == plain["calls"]
        assert hpz["losses"] == plain["losses"] and _same_weights(hpz["weights"], plain["weights"])
