"""The collective save and load of one checkpoint version, shared by ZeroEngine and the torch trainers.

A save (:func:`save_version`), on every rank of the default group:

1. rank 0 picks a fresh folder name for the training step; every rank builds what it saves
   (``prepare``) and checks that every floating-point value is finite; rank 0 creates the folder.
   One agreement: any rank's failure (a non-JSON value, NaN/inf weights of a diverged run, an
   unwritable directory) raises :class:`CheckpointError` on every rank before anything is written.
2. DCP writes the state (one file per rank, fsynced; the tensors of ``Prepared.sources`` are
   produced one at a time as they are written, and checked finite then: ``checkpoint_stream.py``);
   each rank writes its own ``rank-<r>.pt`` if it has one and checksums the files it wrote; rank 0
   writes ``meta.json`` with all checksums and the ``parent`` version. Agreement.
3. rank 0 points ``LATEST`` at the folder (the one atomic step that makes it visible). Agreement.
4. rank 0 removes the versions of this run past the newest ``keep`` (``checkpoint_files.retire``).

A failure at any step raises on every rank, leaves ``LATEST`` and every older version as they
were, and removes the new folder (rank 0, once every rank is past its writes). A process killed
mid-save leaves its folder without ``meta.json``; loads ignore it and a later save warns about it.

A load (:func:`locate`, then :func:`read_state`): each rank finds the version ``LATEST`` names,
checks its ``meta.json`` and verifies its share of the checksums (``checkpoint_files.verify``),
and reads the DCP metadata through the restricted unpickler; the caller agrees on the outcome
before DCP reads any data, through :class:`checkpoint_safe.SafeReader` and ``SafeLoadPlanner``.
"""

from __future__ import annotations

import json
import os
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from zeropp.comm.backend import backend_all_reduce
from zeropp.comm.objects import all_gather_json

from . import checkpoint_files as cf
from . import checkpoint_stream as cs
from .batch import on_ranks, per_rank
from .checkpoint_files import CheckpointError
from .checkpoint_safe import METADATA, SafeLoadPlanner, SafeReader, read_metadata


@dataclass(frozen=True, kw_only=True)
class Origin:
    """The version a training state was last saved to or loaded from: a new save into the same
    directory records it as its ``parent``, which is how retention knows this run's versions."""

    root: str
    """The checkpoint directory, resolved."""
    name: str
    """The version folder's name."""

    @property
    def path(self) -> Path:
        """The version folder."""
        return Path(self.root) / self.name

    def parent_in(self, root: Path) -> str | None:
        """This version's name if it lives in ``root``, else None (a save elsewhere starts a chain)."""
        return self.name if Path(self.root) == root.resolve() else None

    @classmethod
    def of(cls, d: Path) -> Origin:
        """The version in folder ``d``."""
        return cls(root=str(d.parent.resolve()), name=d.name)

    @property
    def token(self) -> int:
        """A non-zero number naming this version, for :func:`agree`: equal on the ranks that found
        the same version, so a load refuses ranks that read different ones."""
        return zlib.crc32(self.name.encode()) + 1


@dataclass(kw_only=True)
class Prepared:
    """What one rank saves, built by the caller's ``prepare``."""

    state: dict[str, Any]
    """The DCP state dict (tensors, DTensors, plain values)."""
    meta: dict[str, Any]
    """JSON values for ``meta.json`` (rank 0's are written)."""
    rank_meta: dict[str, Any] = field(default_factory=dict)
    """Small JSON values of this rank; ``meta.json`` gets, per key, the list over ranks."""
    rank_state: Any = None
    """This rank's own state (plain containers and tensors), saved as ``rank-<r>.pt``; None: none."""
    sources: dict[str, cs.Source] = field(default_factory=dict)
    """Keys of ``state`` holding a ``checkpoint_stream.placeholder``, each with the function that
    produces its tensor when DCP writes it (state kept in a file is read one piece at a time); its
    values are checked finite then."""


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


FULL_DISK = ("No space left on device", "Disk quota exceeded", "unexpected pos")
"""Words of a write that found no room: the OS's ENOSPC and EDQUOT, and torch's archive writer's
report of a short write (``[enforce fail at inline_container.cc] unexpected pos N vs M``), which
is how a full disk reaches a DCP save, naming neither the disk nor the cause."""


def full_disk_note(failures: dict[int, str], disk: Path | None) -> str:
    """A sentence naming the full disk under ``disk`` when a failure reads as a write that found no
    room, else ``""``. Read off the failures' text, which every rank holds alike (the free space
    changes while the ranks clean up), so every rank raises the same message."""
    if disk is None or not any(w in m for m in failures.values() for w in FULL_DISK):
        return ""
    return (
        f"The disk holding {disk} is full (or over its quota): free space there or save to a larger "
        f"disk (the runner's train.checkpoint_dir). "
    )


def raise_failures(failures: dict[int, str], world: int, what: str, hint: str, disk: Path | None = None) -> None:
    """Raise the :class:`CheckpointError` of ``failures`` (rank -> error), each distinct error once;
    ``disk``: where a save writes, named when the failures read as a full disk."""
    hint = full_disk_note(failures, disk) + hint
    raise CheckpointError(
        f"checkpoint {what} failed {on_ranks(failures)} of {world}: {per_rank(failures)}"
        + (f". {hint}" if hint else ""),
        failures,
    )


def agree(
    device: torch.device, error: str | None, what: str, hint: str, token: int = 0, disk: Path | None = None
) -> None:
    """Collective: raise :class:`CheckpointError` on every rank if ``error`` is set on any rank,
    or if the ranks' ``token`` values differ. One 3-element all-reduce when all is well. ``disk``:
    as :func:`raise_failures`."""
    flag = torch.tensor([1 if error else 0, token, -token], dtype=torch.int64, device=device)
    # through the comm context: this is a save's last collective, maybe the process's last one
    backend_all_reduce(flag, dist.ReduceOp.MAX, None, async_op=False)
    failed, hi, lo = (int(x) for x in flag.tolist())
    if failed:
        msgs = all_gather_json(error, device=device)
        raise_failures({r: m for r, m in enumerate(msgs) if m}, len(msgs), what, hint, disk)
    if hi != -lo:
        raise CheckpointError(
            f"checkpoint {what} failed: the ranks read different checkpoint versions (LATEST "
            f"changed during the load, or the ranks do not see the same directory). Make every "
            f"rank load the same path, with no save running at the same time",
            {},
        )


def ranks_where(device: torch.device, flag: bool) -> list[int]:
    """Collective over the default group: the ranks whose ``flag`` is True (one all-reduce)."""
    flags = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=device)
    flags[dist.get_rank()] = int(flag)
    backend_all_reduce(flags, dist.ReduceOp.SUM, None, async_op=False)  # held by the comm context, as agree's
    return [r for r, f in enumerate(flags.tolist()) if f]


def dcp_failures(exc: CheckpointException) -> dict[int, str]:
    return {int(r): describe(pair[0]) for r, pair in exc.failures.items()}


def _storage_writer(d: Path) -> FileSystemWriter:
    """The DCP writer of one version folder (``checkpoint_stream.storage_writer``)."""
    return cs.storage_writer(d)


def _commit(root: Path, name: str) -> None:
    """Point LATEST at ``name`` (the single atomic step that makes a version visible)."""
    cf.commit(root, name)


def _save_rank_state(d: Path, rank: int, obj: Any) -> None:
    f = d / cf.rank_file(rank)
    with open(f, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())


def save_version(
    root: str | os.PathLike,
    *,
    step: int,
    kind: str,
    prepare: Callable[[], Prepared],
    keep: int,
    origin: Origin | None,
    device: torch.device,
) -> Origin:
    """Collective over the default group: save one version of training step ``step`` into
    ``root``, keeping this run's ``keep`` newest versions. Returns the new version (the ``origin``
    of the next save). On any rank's failure every rank raises :class:`CheckpointError`, ``LATEST``
    and the older versions are untouched and the new folder is removed."""
    root = Path(root)
    me, world = dist.get_rank(), dist.get_world_size()
    obj = [cf.version_name(step) if me == 0 else None]
    dist.broadcast_object_list(obj, src=0, device=device if device.type != "cpu" else None)
    name = obj[0]
    assert name is not None, "rank 0's broadcast fills the name"
    d = root / name
    hint = (
        f"Nothing was committed: {root / cf.LATEST} and the older checkpoints are as they were. Fix the cause "
        f"and save again"
    )
    created, error, prepared, meta_text = False, None, None, ""
    try:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep={keep!r}: keep at least the newest checkpoint (an int >= 1)")
        prepared = prepare()
        bad = cf.first_nonfinite(
            [
                *((k, v) for k, v in prepared.state.items() if k not in prepared.sources),
                ("rank_state", prepared.rank_state),
            ]
        )  # sources: checked as they are written
        if bad is not None:
            raise cs.diverged(bad)
        meta = {
            "format": cf.FORMAT,
            "kind": kind,
            "parent": origin.parent_in(root) if origin else None,
            **prepared.meta,
        }
        meta_text = json.dumps(meta, indent=1)  # fails here, before anything is written, if a value is not JSON
        if me == 0:
            root.mkdir(parents=True, exist_ok=True)
            d.mkdir()  # a fresh name: never write into a folder this save did not create
            created = True
    except Exception as exc:
        error = f"preparing {d}: {describe(exc)}"
    try:
        agree(device, error, "save", hint, disk=root)
        assert prepared is not None
        try:
            dcp.save(
                prepared.state, storage_writer=_storage_writer(d), planner=cs.StreamingSavePlanner(prepared.sources)
            )
        except CheckpointException as exc:  # DCP told every rank who failed
            raise_failures(dcp_failures(exc), world, "save", hint, root)
        error, mine, doing = None, {}, f"writing {d / cf.rank_file(me)}"
        try:
            if prepared.rank_state is not None:
                _save_rank_state(d, me, prepared.rank_state)
            doing = f"checksumming the files rank {me} wrote into {d}"
            mine = cf.written_by(d, me)
        except Exception as exc:
            error = f"{doing}: {describe(exc)}"
        gathered = all_gather_json([mine, prepared.rank_meta], device=device)
        if me == 0 and error is None:
            try:
                meta = json.loads(meta_text)
                meta["files"] = {k: v for files, _ in gathered for k, v in files.items()}
                for key in prepared.rank_meta:
                    meta[key] = [rm[key] for _, rm in gathered]
                if METADATA not in meta["files"]:
                    raise FileNotFoundError(f"DCP wrote no {METADATA} into {d}")
                cf.write_atomic(d / cf.META, json.dumps(meta, indent=1))
            except Exception as exc:
                error = f"writing {d / cf.META}: {describe(exc)}"
        agree(device, error, "save", hint, disk=root)  # every file is on disk before anyone can commit
        error = None
        if me == 0:
            try:
                _commit(root, name)
                created = False  # LATEST names it: whatever stops this save from here on, the folder stays
            except Exception as exc:
                error = f"committing {root / cf.LATEST} -> {name}: {describe(exc)}"
                if cf.named_by_latest(root) == name:  # replaced, then the directory sync failed
                    created = False  # LATEST names it: the folder must stay
                    error += (
                        f". {root / cf.LATEST} does name {name} now, but may not survive a crash of the "
                        f"machine; the older checkpoints were kept. Fix the cause and save again"
                    )
                else:
                    error += f". {hint}"
        agree(device, error, "save", "", disk=root)  # only rank 0 commits: its message says what state it left
    except BaseException:
        if created and cf.named_by_latest(root) != name:  # a stop inside the commit may land after its rename
            try:
                cf.discard(d)
            except OSError as exc:  # the save's own error matters more; say what is left behind
                warnings.warn(
                    f"could not remove {d} after the failed save ({describe(exc)}); it is never loaded, "
                    f"remove it by hand",
                    stacklevel=3,
                )
        raise
    if me == 0:
        cf.retire(root, name, keep)
        left = cf.debris(root, exclude=[name])
        if left:
            warnings.warn(
                f"checkpoint directory {root} holds {left}: folders of saves that were interrupted (no "
                f"meta.json), or being written by another run right now. They are never loaded; remove "
                f"them by hand once no other run saves there",
                stacklevel=3,
            )
    return Origin.of(d)


def locate(root: str | os.PathLike, kind: str) -> tuple[Path, dict]:
    """This rank's part of a load before any data is read: the version ``LATEST`` names, its
    ``meta.json`` (of ``kind``), this rank's share of the checksums, and the DCP metadata read
    through the restricted unpickler. Local: no collective, nothing changed."""
    d = cf.latest(root)
    meta = cf.read_meta(d, kind)
    cf.verify(d, meta, dist.get_rank(), dist.get_world_size())
    if meta["format"] == 2 and dist.get_rank() == 0:
        warnings.warn(
            f"checkpoint {d} was saved by an older version (format 2): its {METADATA} has no checksum "
            f"(it is still read without running code). Save again to upgrade it",
            stacklevel=3,
        )
    read_metadata(d, data_files(meta))
    return d, meta


def data_files(meta: dict) -> set[str] | None:
    """The files a version's DCP metadata may point at (None for format 2, which only listed data files)."""
    return {k for k in meta["files"] if k.endswith(".distcp")} if meta["format"] > 2 else None


def reader(d: Path, meta: dict) -> SafeReader:
    """The DCP reader of version folder ``d``: restricted metadata, data files among the listed ones."""
    return SafeReader(d, data_files(meta))


def read_state(
    state: dict[str, Any],
    d: Path,
    meta: dict,
    *,
    what: str,
    hint: str,
    no_dist: bool = False,
    planner: SafeLoadPlanner | None = None,
) -> None:
    """Load version ``d`` into the DCP state dict ``state`` in place (collective unless ``no_dist``),
    reading non-tensor values with ``weights_only=True`` (``planner``: a ``SafeLoadPlanner``, by
    default a new one); a failure raises :class:`CheckpointError`."""
    try:
        dcp.load(state, storage_reader=reader(d, meta), planner=planner or SafeLoadPlanner(), no_dist=no_dist)
    except CheckpointException as exc:
        raise_failures(dcp_failures(exc), 1 if no_dist else dist.get_world_size(), what, hint)


def read_rank_state(d: Path, meta: dict, rank: int) -> Any:
    """Rank ``rank``'s own state saved in ``d`` (``weights_only``: plain data and tensors), or None."""
    name = cf.rank_file(rank)
    if name not in meta["files"]:
        return None
    return torch.load(d / name, weights_only=True)
