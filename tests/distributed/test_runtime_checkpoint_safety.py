"""Checkpoints off the happy path, on a 2-rank gloo world: two runs sharing a directory with other
projects' folders (retention keeps each run's newest and touches nothing else), folders named by
the training step, every failure path of a save (non-finite weights, checksum, meta.json, commit)
leaving LATEST and the older versions as they were and no partial folder, a crafted ``.metadata``
with recomputed checksums refused on every rank without running it (also through the runner's
``resume=true``), the torch trainers' save/load through the same format."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.checkpoint_helpers import checkpoint_error, plant_metadata
from tests.runtime_helpers import TINY, make_model, rank_batches
from tests.worlds import run_world

DEBRIS = "ckpt-00000005-00000000000000ae"


def _engine(seed):
    from zeropp.comm import Topology
    from zeropp.runtime import OptimizerConfig, ZeroConfig, ZeroEngine

    return ZeroEngine(
        make_model(seed=seed),
        config=ZeroConfig(stage=3),
        optimizer=OptimizerConfig(lr=1e-2),
        topology=Topology(nodes=1, ranks_per_node=2),
    )


def _listing(root: Path) -> list[str]:
    dist.barrier()  # every rank is past the previous step before rank 0 looks
    return sorted(p.name for p in root.iterdir())


def _safety_world(rank, world, root, marker):
    from zeropp.runtime import checkpoint_files, checkpoint_io

    root, out = Path(root), {}
    if rank == 0:
        (root / "ckpt-epoch-7-other-project").mkdir(parents=True)
        (root / "ckpt-epoch-7-other-project" / "notes.txt").write_text("another project's")
        (root / "README").write_text("not ours")
        (root / DEBRIS).mkdir()  # what a save killed before its meta.json leaves (or one in progress elsewhere)
        (root / DEBRIS / "__0_0.distcp").write_bytes(b"half")
    a, b = _engine(0), _engine(1)  # two runs sharing the directory
    names = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for eng, step in ((a, 10), (b, 11), (a, 20), (a, 30), (b, 21)):
            eng.train_step(rank_batches(step, 1, rank, TINY, text=True))
            names[step] = Path(eng.save_checkpoint(root, extra={"step": step})).name
    out["names"], out["after_saves"] = names, _listing(root)
    out["debris_warnings"] = [str(w.message) for w in caught if DEBRIS in str(w.message)]

    # every failure path of a save: every rank raises, nothing changes in the directory
    before = _listing(root)
    master = a.optim.masters[0]
    if rank == 1:
        kept = master[0].item()
        master[0] = float("nan")  # a diverged run (rank 1's shard only)
    out["nan"] = checkpoint_error(lambda: a.save_checkpoint(root, extra={"step": 40}))
    if rank == 1:
        master[0] = kept
    out["nan_listing"] = _listing(root)
    real_written, real_atomic, real_commit = (
        checkpoint_files.written_by,
        checkpoint_files.write_atomic,
        checkpoint_io._commit,
    )

    def disk_full(*args):
        raise OSError(28, "No space left on device")

    def commit_then_fail(root_, name):
        real_commit(root_, name)
        raise OSError(5, "Input/output error (fsync)")

    out["failures"] = {}
    for where, r_fail in (("checksum", 1), ("meta", 0)):
        if rank == r_fail:
            setattr(checkpoint_files, "written_by" if where == "checksum" else "write_atomic", disk_full)
        try:
            out["failures"][where] = checkpoint_error(lambda: a.save_checkpoint(root, extra={"step": 40}))
        finally:
            checkpoint_files.written_by, checkpoint_files.write_atomic = real_written, real_atomic
        out["failures"][where]["listing"] = _listing(root)
    checkpoint_io._commit = commit_then_fail
    try:
        out["late_commit"] = checkpoint_error(lambda: a.save_checkpoint(root, extra={"step": 40}))
    finally:
        checkpoint_io._commit = real_commit
    out["late_listing"] = _listing(root)
    out["before"] = before

    # a stop (Ctrl-C, the launcher's SIGTERM) landing on rank 0 right after its commit: LATEST names the
    # new version, so the stop's unwinding must not remove that folder (the last good checkpoint)
    real_agree = checkpoint_io.agree

    def stopped_after_commit(device, error, what, hint, token=0, disk=None):
        real_agree(device, error, what, hint, token, disk)
        if hint == "":  # the agreement that follows the commit (rank 0's message only)
            raise KeyboardInterrupt

    if rank == 0:
        checkpoint_io.agree = stopped_after_commit
    try:
        a.save_checkpoint(root, extra={"step": 40})
        out["stopped"] = False
    except KeyboardInterrupt:
        out["stopped"] = True
    finally:
        checkpoint_io.agree = real_agree
    dist.barrier()
    named = (root / "LATEST").read_text().strip()
    out["stop_after_commit"] = (named, (root / named / "meta.json").is_file(), named in out["late_listing"])

    # a checkpoint of the previous format (2: no kind/parent, only the data files checksummed) loads
    old = root.parent / "format2"
    if rank == 0:
        d = checkpoint_files.latest(root)
        shutil.copytree(d, old / d.name)
        meta = json.loads((d / "meta.json").read_text())
        meta = {k: v for k, v in meta.items() if k not in ("kind", "parent")} | {"format": 2}
        meta["files"] = {k: v for k, v in meta["files"].items() if k.endswith(".distcp")}
        (old / d.name / "meta.json").write_text(json.dumps(meta))
        (old / "LATEST").write_text(d.name + "\n")
    dist.barrier()
    c = _engine(7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["format2_extra"] = c.load_checkpoint(old)
    out["format2_same"] = all(torch.equal(x, y) for x, y in zip(a.optim.masters, c.optim.masters))
    out["format2_warned"] = any("format 2" in str(w.message) for w in caught)

    # a crafted .metadata with its checksum recomputed: refused on every rank, nothing runs
    if rank == 0:
        plant_metadata(checkpoint_files.latest(root), Path(marker))
    dist.barrier()
    c.close()
    c = _engine(7)
    untouched = [m.clone() for m in c.optim.masters]
    out["crafted"] = checkpoint_error(lambda: c.load_checkpoint(root))
    out["crafted_state_untouched"] = all(torch.equal(x, y) for x, y in zip(untouched, c.optim.masters))
    latest = (root / "LATEST").read_text()
    dist.barrier()
    if rank == 0:
        (root / "LATEST").write_text("../../elsewhere\n")
    dist.barrier()
    out["outside"] = checkpoint_error(lambda: c.load_checkpoint(root))
    dist.barrier()
    if rank == 0:
        (root / "LATEST").write_text(latest)  # the runner test resumes from the crafted one
    for eng in (a, b, c):
        eng.close()

    # the torch trainers' format: retention, per-rank state, NaN refused, kind checked
    from zeropp.experiments.runner.torch_checkpoint import load_dcp, save_dcp

    root2 = root.parent / "torch"
    origin = None
    for step in (1, 2, 3):
        state = {"w": torch.full((4,), float(step)), "sched": {"last_epoch": step}}
        origin = save_dcp(state, root2, {"step": step}, per_rank={"calls": rank * 100 + step}, keep=2, origin=origin)
    out["torch_listing"] = _listing(root2)
    state = {"w": torch.zeros(4), "sched": {"last_epoch": 0}}
    extra, mine, _ = load_dcp(state, root2)
    out["torch_loaded"] = (extra, mine, state["w"].tolist(), state["sched"])
    out["torch_nan"] = checkpoint_error(lambda: save_dcp({"w": torch.tensor([1.0, float("inf")])}, root2, {"step": 4}))
    out["torch_nan_listing"] = _listing(root2)
    out["torch_from_engine"] = checkpoint_error(lambda: load_dcp({"w": torch.zeros(4)}, root))
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    base = tmp_path_factory.mktemp("safety")
    marker = base / "pwned"
    res = run_world(_safety_world, 2, str(base / "ckpt"), str(marker), timeout=120)
    return base, marker, res


def test_two_runs_share_a_directory_and_keep_their_own_newest(world):
    base, _, res = world
    names, listing = res[0]["names"], res[0]["after_saves"]
    for step, name in names.items():
        assert name.startswith(f"ckpt-{step:08d}-"), (step, name)  # the training step, not the optimizer's count
    # run a kept 30 and 20 (10 removed), run b kept 11 and 21; the other project's folder and file are untouched,
    # and so is the debris of an interrupted save (it may be another run's save in progress), with a warning
    assert listing == sorted(
        ["LATEST", "README", "ckpt-epoch-7-other-project", DEBRIS, names[11], names[20], names[21], names[30]]
    ), listing
    assert (base / "ckpt" / "ckpt-epoch-7-other-project" / "notes.txt").read_text() == "another project's"
    assert len(res[0]["debris_warnings"]) == 5 and "interrupted" in res[0]["debris_warnings"][0]
    assert res[1]["debris_warnings"] == []  # rank 0 looks after the directory


def test_failed_saves_change_nothing(world):
    _, _, res = world
    for r in res:
        nan = r["nan"]
        assert nan is not None and nan["failures"] == [1], nan
        assert "NaN or inf" in nan["msg"] and "units." in nan["msg"] and ".masters" in nan["msg"], nan["msg"]
        assert r["nan_listing"] == r["before"]  # rank 0 had created the folder: removed
        for where, rank in (("checksum", 1), ("meta", 0)):
            f = r["failures"][where]
            assert f["failures"] == [rank] and "No space left on device" in f["msg"], (where, f)
            assert "LATEST" in f["msg"] and f["listing"] == r["before"], (where, f)
        late = r["late_commit"]
        assert late is not None and late["failures"] == [0] and "Input/output error" in late["msg"], late
        # LATEST was replaced before the failure: that folder stays (and nothing older was removed)
        new = set(r["late_listing"]) - set(r["before"])
        assert (
            len(new) == 1 and next(iter(new)).startswith("ckpt-00000040-") and set(r["before"]) < set(r["late_listing"])
        )


def test_a_stop_right_after_the_commit_keeps_the_version_latest_names(world):
    _, _, res = world
    assert [r["stopped"] for r in res] == [True, False]
    named, complete, older = res[0]["stop_after_commit"]
    assert named.startswith("ckpt-00000040-") and complete and not older, res[0]["stop_after_commit"]


def test_previous_format_still_loads(world):
    _, _, res = world
    for rank, r in enumerate(res):
        assert r["format2_extra"] == {"step": 40} and r["format2_same"]
        assert r["format2_warned"] == (rank == 0)  # rank 0 says it once


def test_crafted_metadata_is_refused_on_every_rank(world):
    _, marker, res = world
    for r in res:
        c = r["crafted"]
        assert c is not None and c["failures"] == [0, 1], c
        assert "posix.system" in c["msg"] and ".metadata" in c["msg"] and "refusing" in c["msg"], c["msg"]
        assert r["crafted_state_untouched"]
        o = r["outside"]
        assert o is not None and "not a checkpoint folder name" in o["msg"], o
    assert not marker.exists()


def test_torch_trainer_checkpoints_share_the_format(world):
    _, _, res = world
    for rank, r in enumerate(res):
        listing = r["torch_listing"]
        assert listing[0] == "LATEST" and [n[:13] for n in listing[1:]] == ["ckpt-00000002", "ckpt-00000003"]
        extra, mine, w, sched = r["torch_loaded"]
        assert (
            extra == {"step": 3} and mine == {"calls": rank * 100 + 3} and w == [3.0] * 4 and sched == {"last_epoch": 3}
        )
        assert (
            r["torch_nan"] is not None and "NaN or inf" in r["torch_nan"]["msg"] and "'w'" not in r["torch_nan"]["msg"]
        )
        assert "w holds NaN" in r["torch_nan"]["msg"] and r["torch_nan_listing"] == listing
        tfe = r["torch_from_engine"]
        assert tfe is not None and "saved by trainer=zeropp" in tfe["msg"], tfe


def test_runner_resume_refuses_crafted_metadata(world, tmp_path):
    base, marker, _ = world
    env = {k: v for k, v in os.environ.items() if k != "ZEROPP_INJECT_FAULT"}
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "zeropp.experiments.run",
            "topology=1x2",
            "logger=none",
            "model=tiny",
            "train.steps=100",  # after the crafted checkpoint's step 40: the load is reached
            "resume=true",
            f"train.checkpoint_dir={base / 'ckpt'}",
            f"hydra.run.dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=150,
        env=env,
    )
    assert p.returncode != 0, p.stdout[-2000:]
    assert "posix.system" in p.stderr and ".metadata" in p.stderr and "refusing" in p.stderr, p.stderr[-3000:]
    assert not marker.exists()
