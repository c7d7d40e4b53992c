"""Shared pieces of the checkpoint tests: crafted checkpoint files (pickles that run a command
when unpickled, as an attacker would write them, and meta.json checksums recomputed to match
them) and :func:`checkpoint_error`, which a rank function uses to return a collective failure."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any, Callable


class RunsCommand:
    """Pickles to ``os.system(command)``: unpickling it runs the command."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def touch_command(marker: Path) -> str:
    return f"touch {marker}"


def recompute_checksum(folder: Path, name: str) -> None:
    """Rewrite ``folder/meta.json`` so that file ``name`` passes its checksum (what an attacker
    who replaced the file would do: the checksums only catch accidents)."""
    from zeropp.runtime.checkpoint_files import crc32

    meta_file = folder / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["files"][name] = crc32(folder / name)
    meta_file.write_text(json.dumps(meta))


def plant_metadata(folder: Path, marker: Path) -> None:
    """Replace ``folder/.metadata`` by a pickle that touches ``marker`` when loaded, checksum recomputed."""
    (folder / ".metadata").write_bytes(pickle.dumps(RunsCommand(touch_command(marker))))
    recompute_checksum(folder, ".metadata")


def write_version(root: Path, name: str, *, parent: str | None, fmt: int = 3) -> Path:
    """A minimal version folder: one data file and a meta.json naming ``parent`` (for retention tests)."""
    d = root / name
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(b"data")
    (d / "meta.json").write_text(json.dumps({"format": fmt, "kind": "engine", "parent": parent, "files": {}}))
    return d


def checkpoint_error(fn: Callable[[], Any]) -> dict | None:
    """Run ``fn`` on this rank; the ``CheckpointError`` it raised as ``{"msg", "failures"}`` (picklable,
    for a rank function's result), or None when it did not raise."""
    from zeropp.runtime import CheckpointError

    try:
        fn()
    except CheckpointError as e:
        return {"msg": str(e), "failures": sorted(e.failures)}
    return None


def peak_host_bytes(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``fn`` and return ``(its result, the peak of the host bytes allocated during it)``:
    torch's CPU allocator as the profiler records it (``profile_memory``; every tensor's memory,
    counted from zero when ``fn`` starts, frees of older tensors included). Python objects (file
    reads into ``bytes``) are not counted."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    with tempfile.TemporaryDirectory() as d:
        trace = os.path.join(d, "trace.json")
        prof.export_chrome_trace(trace)
        with open(trace) as f:
            events = json.load(f)["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    return result, max([0, *totals])
