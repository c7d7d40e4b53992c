"""Coalesced units (``ZeroConfig.coalesce_numel``) in checkpoints, on a 2-rank gloo world.

A checkpoint holds one layout per unit, so it loads where the blocks are coalesced alike: at another
stage with the same threshold the weights come back exactly; with another threshold every rank is
refused, before anything is changed, with a message naming the units and ``coalesce_numel``.
Training parity of coalesced stage-3 and stage-2 engines is in ``test_runtime_parity``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.runtime_helpers import TINY, make_model, rank_batches
from tests.worlds import run_world

ALL = 10**9
"""A threshold over the tiny GPT's blocks: one ``block0-1`` unit."""


def _engine(stage: int, coalesce: int, seed: int):
    from zeropp.comm import Topology
    from zeropp.runtime import OptimizerConfig, ZeroConfig, ZeroEngine

    return ZeroEngine(
        make_model(seed=seed),
        config=ZeroConfig(stage=stage, coalesce_numel=coalesce),
        optimizer=OptimizerConfig(lr=1e-2),
        topology=Topology(nodes=1, ranks_per_node=2),
    )


def _world(rank: int, world: int, path: str) -> dict:
    saver = _engine(3, ALL, seed=0)
    for s in range(2):
        saver.train_step(rank_batches(s, 1, rank, TINY))
    saver.save_checkpoint(path, {"step": 2})
    saved = saver.consolidated_state_dict()
    names = [u.name for u in saver.units]
    saver.close()

    same = _engine(2, ALL, seed=1)  # another stage, the same coalescing: loads exactly
    same.load_checkpoint(path)
    loaded = same.consolidated_state_dict()
    same.close()
    exact = all(torch.equal(saved[k], loaded[k]) for k in saved)

    from zeropp.runtime.checkpoint_io import CheckpointError

    other = _engine(3, 0, seed=1)  # one unit per block: refused, weights untouched
    before = other.consolidated_state_dict()
    try:
        other.load_checkpoint(path)
        error = None
    except CheckpointError as e:
        error = str(e)
    after = other.consolidated_state_dict()
    other.close()
    untouched = all(torch.equal(before[k], after[k]) for k in before)
    return dict(names=names, exact=exact, error=error, untouched=untouched)


def test_a_checkpoint_loads_with_the_same_coalescing_and_is_refused_with_another(tmp_path: Path) -> None:
    for r in run_world(_world, 2, str(tmp_path / "ckpt"), timeout=180):
        assert r["names"] == ["root", "block0-1"]
        assert r["exact"]
        assert r["error"] is not None and "coalesce_numel" in r["error"] and "block0-1" in r["error"], r["error"]
        assert r["untouched"]
