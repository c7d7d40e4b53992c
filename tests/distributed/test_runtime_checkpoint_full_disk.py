"""A checkpoint save onto a disk that fills up part-way: the error names the full disk.

Torch's archive writer reports a short write as ``[enforce fail at inline_container.cc] unexpected
pos ... vs ...``, which says nothing of the disk; DCP passes that on. The save's error now says
when the checkpoint directory's disk has no room left. Needs root (a tiny tmpfs is mounted).
"""

from __future__ import annotations

from tests.runtime_helpers import make_model, rank_batches, tiny_tmpfs
from tests.worlds import run_world


def _save_world(rank: int, world: int, root: str) -> str:
    from zeropp.comm import Topology
    from zeropp.runtime import OptimizerConfig, ZeroConfig, ZeroEngine
    from zeropp.runtime.checkpoint_files import CheckpointError

    eng = ZeroEngine(
        make_model(seed=0),
        config=ZeroConfig(stage=3),
        optimizer=OptimizerConfig(lr=1e-2),
        topology=Topology(nodes=1, ranks_per_node=world),
    )
    eng.train_step(rank_batches(0, 1, rank))
    try:
        eng.save_checkpoint(root, extra={"step": 1})
    except CheckpointError as e:
        return str(e)
    finally:
        eng.close()
    return "saved"


def test_a_save_onto_a_full_disk_says_the_disk_is_full(tmp_path):
    with tiny_tmpfs(tmp_path) as d:
        out = run_world(_save_world, 2, str(d / "ck"))
        assert out[0] == out[1] != "saved", out
        assert f"The disk holding {d / 'ck'} is full (or over its quota)" in out[0] and "larger disk" in out[0], out[0]
        assert "Nothing was committed" in out[0], out[0]
        assert sorted(p.name for p in (d / "ck").iterdir()) == [], "the partial folder is removed"
