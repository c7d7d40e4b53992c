"""Checkpoint files without a process group: LATEST that points elsewhere, crafted pickles, corrupt
or substituted files, retention that must touch only the run's own versions, NaN detection."""

from __future__ import annotations

import json
import os
import pickle
import stat
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo

from tests.checkpoint_helpers import RunsCommand, plant_metadata, recompute_checksum, touch_command, write_version
from zeropp.runtime import checkpoint_files as cf
from zeropp.runtime import checkpoint_io as cio
from zeropp.runtime.checkpoint_safe import (
    SafeLoadPlanner,
    SafeReader,
    UnsafeCheckpointError,
    read_metadata,
    tensor_entry,
)

A, B, C, D = (f"ckpt-{s:08d}-{s:016x}" for s in (1, 2, 3, 4))


def _dcp_save(d: Path, state: dict) -> None:
    with warnings.catch_warnings():  # DCP warns that no process group is used: that is the intent
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=FileSystemWriter(d, single_file_per_rank=True, thread_count=1), no_dist=True)


def _dcp_load(state: dict, reader, planner) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)


def _version(root: Path, name: str = A, state: dict | None = None) -> Path:
    """A real one-process version folder with every file checksummed, as a save writes it."""
    d = root / name
    _dcp_save(d, state or {"w": torch.arange(4.0), "b": torch.ones(2, dtype=torch.bfloat16), "sched": {"epoch": 3}})
    meta = {"format": cf.FORMAT, "kind": "engine", "parent": None, "files": cf.written_by(d, 0)}
    (d / "meta.json").write_text(json.dumps(meta))
    return d


def test_latest_must_name_a_version_folder_inside_the_directory(tmp_path):
    root = tmp_path / "ckpt"
    good = _version(root)
    outside = _version(tmp_path / "elsewhere", name=B)
    (root / "LATEST").write_text(A + "\n")
    assert cf.latest(root) == good
    for bad, words in [
        ("../../elsewhere/" + B, "not a checkpoint folder name"),
        (str(outside), "not a checkpoint folder"),
        ("step-00000003", "not a checkpoint folder name"),
        ("ckpt-epoch-7-other-project", "no path"),
    ]:
        (root / "LATEST").write_text(bad + "\n")
        with pytest.raises(ValueError, match=words):
            cf.latest(root)
    (root / C).symlink_to(outside, target_is_directory=True)  # named like ours, pointing out of the directory
    (root / "LATEST").write_text(C + "\n")
    with pytest.raises(ValueError, match="is a symlink"):
        cf.latest(root)
    (root / "LATEST").write_text(D + "\n")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        cf.latest(root)


def test_crafted_metadata_is_refused_without_running_it(tmp_path):
    d = _version(tmp_path)
    marker = tmp_path / "pwned"
    plant_metadata(d, marker)
    with pytest.raises(UnsafeCheckpointError, match=r"posix\.system.*refusing"):
        read_metadata(d)
    with pytest.raises(UnsafeCheckpointError, match="posix.system"):
        SafeReader(d).read_metadata()  # what DCP's load calls
    assert not marker.exists()
    cf.verify(
        d, json.loads((d / "meta.json").read_text()), 0, 1
    )  # the recomputed checksum passes: only the reader stops it
    with open(d / ".metadata", "rb") as f:  # the control: torch's own reader runs it
        pickle.load(f)
    assert marker.exists()


def test_safe_metadata_matches_torch_and_refuses_paths_out_of_the_folder(tmp_path):
    d = _version(tmp_path)
    mine, torch_md = read_metadata(d, {"__0_0.distcp"}), FileSystemReader(d).read_metadata()
    assert mine.state_dict_metadata == torch_md.state_dict_metadata and mine.storage_data == torch_md.storage_data
    md = FileSystemReader(d).read_metadata()
    key = next(iter(md.storage_data))
    md.storage_data[key] = _StorageInfo(relative_path="../../etc/passwd", offset=0, length=4)
    (d / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(UnsafeCheckpointError, match="etc/passwd"):
        read_metadata(d)
    md.storage_data[key] = _StorageInfo(relative_path="__9_0.distcp", offset=0, length=4)  # a plain name, not listed
    (d / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(UnsafeCheckpointError, match="not one of the checkpoint's files"):
        read_metadata(d, {"__0_0.distcp"})


def test_export_consolidated_refuses_crafted_metadata(tmp_path):
    from zeropp.runtime import export_consolidated

    d = _version(tmp_path)
    meta = json.loads((d / "meta.json").read_text())
    (d / "meta.json").write_text(json.dumps(meta | {"units": [], "model_state": {}, "param_dtypes": {}}))
    (tmp_path / "LATEST").write_text(A + "\n")
    marker = tmp_path / "pwned"
    plant_metadata(d, marker)
    with pytest.raises(UnsafeCheckpointError, match="posix.system"):
        export_consolidated(tmp_path, tmp_path / "full.pt")
    assert not marker.exists() and not (tmp_path / "full.pt").exists()


def test_non_tensor_values_are_read_weights_only(tmp_path):
    marker = tmp_path / "pwned"
    d = tmp_path / "v"
    _dcp_save(d, {"w": torch.ones(2), "sched": RunsCommand(touch_command(marker))})  # pickled, not run, at save
    assert not marker.exists()
    state = {"w": torch.zeros(2), "sched": None}
    with pytest.raises(CheckpointException) as info:
        _dcp_load(state, SafeReader(d), SafeLoadPlanner())
    why = info.value.failures[0][0]
    assert isinstance(why, UnsafeCheckpointError) and "'sched'" in str(why) and "posix.system" in str(why), why
    assert not marker.exists()
    _dcp_load({"w": torch.zeros(2), "sched": None}, FileSystemReader(d), DefaultLoadPlanner())  # the control
    assert marker.exists()
    ok = tmp_path / "ok"
    _dcp_save(ok, {"w": torch.ones(2), "sched": {"last_epoch": 3, "lrs": [0.1, (0.9, 0.95)], "fn": None}})
    state = {"w": torch.zeros(2), "sched": {"last_epoch": 0, "lrs": None, "fn": None}}  # the keys to load
    _dcp_load(state, SafeReader(ok), SafeLoadPlanner())
    assert state["sched"] == {"last_epoch": 3, "lrs": [0.1, (0.9, 0.95)], "fn": None} and torch.equal(
        state["w"], torch.ones(2)
    )


def test_tensor_entry_refuses_a_record_that_holds_bytes(tmp_path):
    """A checkpoint whose entry under a tensor's name holds a pickled value (another writer's file)."""
    d = tmp_path / "v"
    _dcp_save(d, {"w": torch.ones(2, 3, dtype=torch.bfloat16), "sched": "cosine"})
    md = read_metadata(d).state_dict_metadata
    w = tensor_entry(md, "w")
    assert tuple(w.size) == (2, 3) and w.properties.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="'sched' holds BytesStorageMetadata, not a tensor"):
        tensor_entry(md, "sched")


def test_rank_state_is_loaded_weights_only(tmp_path):
    d = _version(tmp_path)
    marker = tmp_path / "pwned"
    with open(d / "rank-0.pt", "wb") as f:
        torch.save({"stochastic_calls": RunsCommand(touch_command(marker))}, f)
    recompute_checksum(d, "rank-0.pt")
    meta = json.loads((d / "meta.json").read_text())
    cf.verify(d, meta, 0, 1)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        cio.read_rank_state(d, meta, 0)
    assert not marker.exists()


def test_verify_names_the_corrupt_missing_or_substituted_file(tmp_path):
    d = _version(tmp_path)
    meta = json.loads((d / "meta.json").read_text())
    assert set(meta["files"]) == {".metadata", "__0_0.distcp"}
    cf.verify(d, meta, 0, 1)
    data = (d / "__0_0.distcp").read_bytes()
    (d / "__0_0.distcp").write_bytes(data[:-8])
    with pytest.raises(ValueError, match=r"__0_0\.distcp fails its checksum"):
        cf.verify(d, meta, 0, 1)
    cf.verify(d, meta, 1, 2)  # rank 1 of 2 is not responsible for rank 0's file; rank 0 is
    (d / "__0_0.distcp").unlink()
    (tmp_path / "copy").write_bytes(data)
    (d / "__0_0.distcp").symlink_to(tmp_path / "copy")  # the right bytes, but not the file the save wrote
    with pytest.raises(ValueError, match="is a symlink"):
        cf.verify(d, meta, 0, 1)
    (d / "__0_0.distcp").unlink()
    with pytest.raises(FileNotFoundError, match=r"__0_0\.distcp is missing"):
        cf.verify(d, meta, 0, 1)
    del meta["files"][".metadata"]
    with pytest.raises(ValueError, match="no checksum for .metadata"):
        cf.verify(d, meta, 0, 1)
    meta["files"]["../x"] = 0
    with pytest.raises(ValueError, match="not a file of the folder"):
        cf.verify(d, {**meta, "format": 2}, 0, 1)


def test_read_meta_refuses_another_trainers_checkpoint(tmp_path):
    d = _version(tmp_path)
    cf.read_meta(d, "engine")
    with pytest.raises(ValueError, match=r"saved by trainer=zeropp .* this run is trainer=fsdp2/ddp"):
        cf.read_meta(d, "torch")


def test_retention_removes_only_the_runs_own_older_versions(tmp_path):
    root = tmp_path / "ckpt"
    outside = tmp_path / "outside"
    # our chain D -> C -> B -> A, and a version of our chain that is a symlink to a folder elsewhere
    write_version(root, A, parent=None)
    write_version(root, B, parent=A)
    linked = write_version(outside, "ckpt-00000002-00000000000000ff", parent=None)
    (root / linked.name).symlink_to(linked, target_is_directory=True)
    write_version(root, C, parent=linked.name)
    write_version(root, D, parent=C)
    # not ours: another project's ckpt-*, another run's chain, a file, an older-format folder, crash debris
    other = root / "ckpt-epoch-7-other-project"
    other.mkdir()
    (other / "meta.json").write_text(json.dumps({"format": 3, "parent": None, "files": {}}))
    theirs = [
        write_version(root, "ckpt-00000003-00000000000000aa", parent=None).name,
        write_version(root, "ckpt-00000004-00000000000000ab", parent="ckpt-00000003-00000000000000aa").name,
    ]
    (root / "ckpt-00000001-00000000000000ac").write_text("a file named like a version")
    write_version(root, "ckpt-00000000-00000000000000ad", parent=None, fmt=1)
    debris = root / "ckpt-00000005-00000000000000ae"
    debris.mkdir()
    (root / "LATEST").write_text(D + "\n")
    before = sorted(p.name for p in root.iterdir())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not even an attempt to remove something
        assert cf.retire(root, D, keep=2) == []  # C's parent is a symlink: the chain stops there, nothing followed
    assert sorted(p.name for p in root.iterdir()) == before and linked.is_dir()
    (root / linked.name).unlink()
    write_version(root, linked.name, parent=B)  # now a real folder of the chain D -> C -> L -> B -> A
    (root / "LATEST").write_text(B + "\n")  # what LATEST names is never removed
    assert cf.retire(root, D, keep=2) == [linked.name, A]
    assert sorted(p.name for p in root.iterdir()) == sorted(set(before) - {A, linked.name})
    assert (outside / linked.name).is_dir() and other.is_dir() and all((root / t).is_dir() for t in theirs)
    assert cf.debris(root) == [debris.name]


def test_first_nonfinite_names_the_tensor(tmp_path):
    ok = {"a": torch.ones(3), "steps": torch.tensor([2**62], dtype=torch.int64), "empty": torch.empty(0)}
    assert cf.first_nonfinite(ok.items()) is None
    bad = {
        "model": {"w": torch.ones(3), "layers": [torch.zeros(2), torch.tensor([1.0, float("inf")])]},
        "b": torch.tensor([float("nan")], dtype=torch.bfloat16),
    }
    assert cf.first_nonfinite(bad.items()) == "model.layers.1"
    assert cf.first_nonfinite([("b", bad["b"])]) == "b"


def test_commit_leaves_no_temporary_file_when_it_fails(tmp_path):
    (tmp_path / "LATEST").mkdir()  # the rename over it fails after the temporary file is written
    with pytest.raises(IsADirectoryError):
        cf.commit(tmp_path, A)
    assert [p.name for p in tmp_path.iterdir()] == ["LATEST"]


def test_write_atomic_keeps_the_replaced_files_permissions(tmp_path):
    kept = tmp_path / "report.md"
    kept.write_text("old\n")
    kept.chmod(0o640)
    cf.write_atomic(kept, "new\n")
    assert kept.read_text() == "new\n"
    assert stat.S_IMODE(kept.stat().st_mode) == 0o640

    fresh = tmp_path / "fresh.md"
    umask = os.umask(0o022)
    try:
        cf.write_atomic(fresh, b"x")
    finally:
        os.umask(umask)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh.md", "report.md"]


def _torch_trainer_checkpoint(root: Path) -> Path:
    """A checkpoint directory (``LATEST`` and one version) of a torch trainer's model ``{"w": [4]}``."""
    d = _version(root, state={"model.w": torch.arange(4.0)})
    meta = json.loads((d / "meta.json").read_text())
    (d / "meta.json").write_text(json.dumps(meta | {"kind": "torch"}))
    (root / "LATEST").write_text(A + "\n")
    return root


def test_export_consolidated_refuses_an_out_file_it_cannot_write_before_reading(tmp_path, monkeypatch):
    from zeropp.runtime import consolidate, export_consolidated

    ckpt = _torch_trainer_checkpoint(tmp_path / "ckpt")
    read = []
    monkeypatch.setattr(consolidate, "read_consolidated", lambda p: read.append(p) or ({}, {}))
    (tmp_path / "out").mkdir()
    (tmp_path / "afile").write_text("x")
    for bad, words in [
        ("", "empty path"),
        (tmp_path / "out", "is a directory; name a file in it, e.g. "),
        (tmp_path / "missing" / "m.pt", "missing does not exist; create it"),
        (tmp_path / "afile" / "m.pt", "afile is not a directory"),
        ("/proc/m.pt", "cannot write in /proc"),
    ]:
        with pytest.raises(ValueError, match=words):
            export_consolidated(ckpt, bad)
    assert read == [], "the checkpoint was read before the out file was checked"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "ckpt", "out"]
    assert list((tmp_path / "out").iterdir()) == []


def test_export_consolidated_writes_whole_files_and_leaves_no_temporary(tmp_path, monkeypatch):
    from zeropp.runtime import consolidate, export_consolidated

    ckpt = _torch_trainer_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "model.pt"
    out.write_text("an older export")
    assert export_consolidated(ckpt, out) == str(out)  # replaced whole
    assert torch.equal(torch.load(out)["w"], torch.arange(4.0))

    def failing_save(obj, f):
        Path(f).write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(consolidate.torch, "save", failing_save)
    with pytest.raises(OSError, match="No space left"):
        export_consolidated(ckpt, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "model.pt"]  # no .model.pt.tmp<pid> left
    assert torch.equal(torch.load(out)["w"], torch.arange(4.0))  # the previous file untouched


def test_a_meta_json_larger_than_any_we_write_is_refused_unread(tmp_path, monkeypatch) -> None:
    """A ``meta.json`` of more than ``META_LIMIT`` bytes (crafted, or another file under that name)
    is refused before it is read into memory (before: read whole, whatever its size); the runner
    reads it before any rank starts to check a resume."""
    from zeropp.runtime import checkpoint_files as cf

    monkeypatch.setattr(cf, "META_LIMIT", 1024)
    with open(tmp_path / "meta.json", "wb") as f:
        f.truncate(1025)  # sparse: no disk used
    with pytest.raises(ValueError, match=r"meta.json cannot be read \(.*holds 1,025 bytes, more than the 1,024"):
        cf.read_meta(tmp_path)
