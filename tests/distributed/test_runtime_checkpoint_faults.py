"""Checkpoint failures on one rank are collective-safe: every rank raises a CheckpointError naming
the failing rank (no rank hangs at a barrier or the next collective), a failed save leaves the
previous checkpoint loadable, and a failed load changes no state."""

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

from tests.checkpoint_helpers import checkpoint_error
from tests.runtime_helpers import TINY, make_model, rank_batches
from tests.worlds import run_world


def _engine(seed):
    from zeropp.comm import Topology
    from zeropp.runtime import OptimizerConfig, ZeroConfig, ZeroEngine

    return ZeroEngine(
        make_model(seed=seed),
        config=ZeroConfig(stage=3, grad_clip=0.5),
        optimizer=OptimizerConfig(lr=1e-2),
        topology=Topology(nodes=1, ranks_per_node=2),
    )


class DiskFullWriter(FileSystemWriter):
    """A DCP writer whose data write fails as on a full disk."""

    def write_data(self, plan, planner):
        raise OSError(28, "No space left on device")


def _step(eng, rank, s):
    return eng.train_step(rank_batches(s, 1, rank, TINY, text=True)).loss


def _faults_world(rank, world, path):
    from zeropp.runtime import checkpoint_io as checkpoint

    out = {}
    a = _engine(0)
    for s in range(2):
        _step(a, rank, s)
    a.save_checkpoint(path)
    good = (Path(path) / "LATEST").read_text().strip()
    out["ref"] = [_step(a, rank, s) for s in (2, 3)]  # what a resume from the good checkpoint must give

    # 1. a save whose shard write fails on rank 1 only (disk full): every rank raises, naming rank 1
    real_writer = checkpoint._storage_writer
    if rank == 1:
        checkpoint._storage_writer = DiskFullWriter
    try:
        out["save_fail"] = checkpoint_error(lambda: a.save_checkpoint(path))
    finally:
        checkpoint._storage_writer = real_writer
    # 2. a commit that fails (rank 0 only commits): every rank raises, naming rank 0
    real_commit = checkpoint._commit

    def read_only(root, tag):
        raise PermissionError(13, "Permission denied", str(root / "LATEST"))

    checkpoint._commit = read_only
    try:
        out["commit_fail"] = checkpoint_error(lambda: a.save_checkpoint(path))
    finally:
        checkpoint._commit = real_commit
    out["latest_unchanged"] = (Path(path) / "LATEST").read_text().strip() == good
    a.close()

    # 3. the previous checkpoint still loads and reproduces the same losses
    b = _engine(seed=42)
    b.load_checkpoint(path)
    out["resumed"] = [_step(b, rank, s) for s in (2, 3)]
    b.close()

    # 4. load errors from rank 1's file: corrupt, then missing -> every rank raises naming rank 1
    shard = Path(path) / good / "__1_0.distcp"  # rank 1's DCP file
    c = _engine(seed=7)
    before = [m.clone() for m in c.optim.masters]
    dist.barrier()
    if rank == 1:
        shard.write_bytes(b"\x00garbage, not a zip archive")
    dist.barrier()
    out["load_corrupt"] = checkpoint_error(lambda: c.load_checkpoint(path))
    dist.barrier()
    if rank == 1:
        shard.unlink()
    dist.barrier()
    out["load_missing"] = checkpoint_error(lambda: c.load_checkpoint(path))
    out["state_untouched"] = all(torch.equal(x, y) for x, y in zip(before, c.optim.masters))
    out["usable_after"] = _step(c, rank, 0) > 0  # collectives still line up after the failures
    c.close()
    return out


def test_checkpoint_failures_raise_on_every_rank(tmp_path):
    res = run_world(_faults_world, 2, str(tmp_path / "ckpt"), timeout=90)
    for rank, r in enumerate(res):
        sf = r["save_fail"]
        assert sf is not None and sf["failures"] == [1], (rank, sf)
        assert "rank(s) [1]" in sf["msg"] and "No space left on device" in sf["msg"] and "LATEST" in sf["msg"], sf
        cf = r["commit_fail"]
        assert cf is not None and cf["failures"] == [0] and "Permission denied" in cf["msg"], (rank, cf)
        assert r["latest_unchanged"]
        assert r["resumed"] == r["ref"], (rank, r["resumed"], r["ref"])
        lc = r["load_corrupt"]
        assert lc is not None and lc["failures"] == [1] and "corrupt" in lc["msg"] and "__1_0.distcp" in lc["msg"], (
            rank,
            lc,
        )
        lm = r["load_missing"]
        assert lm is not None and lm["failures"] == [1] and "missing" in lm["msg"], (rank, lm)
        assert r["state_untouched"] and r["usable_after"]
