"""The files of a checkpoint directory: version names, ``LATEST``, ``meta.json``, checksums, retention.

Layout under a checkpoint directory ``root`` (one format for the engine and the torch trainers)::

    root/LATEST                          the newest committed version's folder name (one line)
    root/ckpt-<step:08d>-<nonce>/        one version, <step> the training step it holds,
        .metadata  __<r>_<n>.distcp        <nonce> 16 hex digits (rank 0's clock at the save)
        rank-<r>.pt                      rank r's own state (torch trainers), when it has one
        meta.json                        what wrote it, its ``parent``, and a CRC-32 of every other file

Which folders are ours: a name matching :data:`NAME` exactly, a real directory (never a symlink),
with a ``meta.json`` of a readable :data:`FORMAT`. Retention (:func:`retire`) follows the
``parent`` chain from the version just committed (each save records the version its state
continues: the previous save, or the one it was resumed from) and deletes that chain's members
past the newest ``keep``. So it only ever removes versions of the run that saves, never another
run's (two runs sharing a directory have disjoint chains, except a version both resumed from,
which belongs to both), never what ``LATEST`` names, nothing of another name or kind, and it
never follows a symlink. Versions of an abandoned future (a run resumed from an older version)
are not on the chain and stay.

``LATEST`` must hold a plain name matching :data:`NAME` of a real folder directly inside
``root``; anything else (a path, ``..``, a symlink) is refused by :func:`latest`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import shutil
import stat
import time
import warnings
import zlib
from pathlib import Path
from typing import Any, Iterable

import torch

from zeropp.input_files import read_regular

METADATA = ".metadata"
"""The name DCP gives a checkpoint's (global) metadata file."""


class CheckpointError(RuntimeError):
    """A checkpoint save or load failed on at least one rank; raised identically on every rank.

    Defined here, beside the files, rather than with the DCP code that raises it, so that catching
    it (``zeropp.runtime.CheckpointError``) does not import ``torch.distributed.checkpoint``, which
    pulls in DTensor and sympy: seconds of start-up in every rank that never saves."""

    def __init__(self, message: str, failures: dict[int, str]) -> None:
        super().__init__(message)
        self.failures = failures
        """Failing global rank -> its error (``"Type: message"``)."""


FORMAT = 3
"""Format written. 3: every file checksummed, ``kind``, ``parent``; torch trainers in this layout too."""
READABLE = (2, 3)
"""Formats loaded. 2 (engine only): ``.metadata`` has no checksum (it is still read safely)."""
NAME = re.compile(r"ckpt-(\d{8,})-([0-9a-f]{16})")
"""A version folder's name, matched in full."""
LATEST = "LATEST"
META = "meta.json"
_INDEXED = re.compile(r"__(\d+)_\d+\.distcp|rank-(\d+)\.pt")
"""Files written by one rank (index in the name): DCP data files and a rank's own state."""
KINDS = {
    "engine": "trainer=zeropp (ZeroEngine)",
    "torch": "trainer=fsdp2/ddp (torch.distributed.checkpoint state dicts)",
}
"""What wrote a checkpoint -> how to say so."""


def version_name(step: int) -> str:
    """A fresh version folder name for training step ``step``."""
    return f"ckpt-{step:08d}-{time.time_ns():016x}"


def rank_file(rank: int) -> str:
    """The name of rank ``rank``'s own-state file inside a version folder."""
    return f"rank-{rank}.pt"


def version_step(name: str) -> int:
    """The training step a version folder's ``name`` (:data:`NAME`) was saved at."""
    m = NAME.fullmatch(name)
    if m is None:
        raise ValueError(f"{name!r} is not a checkpoint folder name (ckpt-<step>-<16 hex>)")
    return int(m.group(1))


def _is_version(d: Path) -> bool:
    """``d`` is named like a version and is a real directory (a symlink never is)."""
    return NAME.fullmatch(d.name) is not None and not d.is_symlink() and d.is_dir()


def latest(root: str | os.PathLike) -> Path:
    """The version folder ``root/LATEST`` names, checked to be a version folder directly in ``root``."""
    root = Path(root)
    f = root / LATEST
    if not f.is_file():
        raise FileNotFoundError(f"no complete checkpoint under {root} (missing {f})")
    name = f.read_text(errors="replace").strip()
    if NAME.fullmatch(name) is None:
        raise ValueError(
            f"{f} names {name[:200]!r}, which is not a checkpoint folder name (ckpt-<step>-<16 hex>, no "
            f"path): refusing to follow it. Write the name of a folder in {root} into {f}"
        )
    d = root / name
    if d.is_symlink():
        raise ValueError(
            f"{f} names {name}, which is a symlink (to {os.readlink(d)}): a checkpoint folder must be a "
            f"real directory inside {root}; refusing to follow it"
        )
    if not d.is_dir():
        raise FileNotFoundError(f"{f} names {name}, which does not exist in {root}")
    return d


META_LIMIT = 1 << 28
"""Bytes a ``meta.json`` may have (256 MiB: its per-file checksums and unit layouts stay far below
that for any model): a larger file is refused before it is read into memory."""


def read_meta(d: Path, kind: str | None = None) -> dict:
    """The ``meta.json`` of version folder ``d``, checked for a readable format and, if given, ``kind``."""
    f = d / META
    if f.is_symlink() or not f.is_file():
        raise FileNotFoundError(f"{f} is missing (not a complete checkpoint of this format)")
    try:
        meta = json.loads(read_regular(f, META_LIMIT))
    except OSError as exc:  # larger than any meta.json this library writes, or unreadable
        raise ValueError(f"{f} cannot be read ({exc}): not a meta.json of this format") from exc
    except ValueError as exc:
        raise ValueError(f"{f} cannot be read ({type(exc).__name__}: {exc}): the file is corrupt or truncated") from exc
    if not isinstance(meta, dict) or meta.get("format") not in READABLE:
        fmt = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{f}: checkpoint format {fmt} is not one of {list(READABLE)}; re-save it with this version")
    if not isinstance(meta.get("files"), dict):
        raise ValueError(f"{f} has no file checksums: the file is corrupt")
    have = meta.get("kind", "engine")
    if kind is not None and have != kind:
        raise ValueError(
            f"{d} was saved by {KINDS.get(have, have)} and this run is {KINDS.get(kind, kind)}: their "
            f"checkpoints hold different state and do not load into each other. Resume with the trainer "
            f"that saved it, or point train.checkpoint_dir elsewhere"
        )
    return meta


def crc32(f: Path) -> int:
    """CRC-32 of file ``f`` (catches corruption and truncation, not deliberate substitution)."""
    crc = 0
    with open(f, "rb") as fh:
        while chunk := fh.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def written_by(d: Path, rank: int) -> dict[str, int]:
    """Checksums of the files rank ``rank`` wrote into ``d`` (rank 0 also wrote ``.metadata``)."""
    out: dict[str, int] = {}
    for f in d.iterdir():
        m = _INDEXED.fullmatch(f.name)
        if (m and int(m.group(1) or m.group(2)) == rank) or (rank == 0 and f.name == METADATA):
            out[f.name] = crc32(f)
    return out


def verify(d: Path, meta: dict, rank: int, world: int) -> None:
    """Check, on this rank, the files of ``d`` it is responsible for against ``meta["files"]``: the
    shared ``.metadata`` (every rank) and the indexed files ``i % world == rank``. Together the ranks
    check every file. Raises naming the first missing, substituted (symlinked) or corrupt file."""
    files: dict = meta["files"]
    if METADATA not in files and meta.get("format") != 2:
        raise ValueError(f"{d / META} lists no checksum for {METADATA}: not a complete checkpoint of this format")
    for name, crc in sorted(files.items()):
        if Path(name).name != name or name in ("", ".", "..", META):
            raise ValueError(f"{d / META} lists {name!r}, which is not a file of the folder: the file is corrupt")
        m = _INDEXED.fullmatch(name)
        if m is not None and int(m.group(1) or m.group(2)) % world != rank:
            continue
        f = d / name
        if f.is_symlink():
            raise ValueError(f"{f} is a symlink: checkpoint files must be the files the save wrote; refusing it")
        if not f.is_file():
            raise FileNotFoundError(f"{f} is missing (removed after the save, or not visible from this rank)")
        if crc32(f) != crc:
            raise ValueError(f"{f} fails its checksum: the file is corrupt, truncated or not the one saved")


def write_atomic(target: Path, data: str | bytes) -> None:
    """Write ``data`` (text as UTF-8) to a temporary file and rename it over ``target``: readers see
    old or new, never part of it. The temporary file has a fresh random name, created exclusively,
    and is removed if anything fails. Its permission bits are those a plain write would leave: the
    replaced file's own when ``target`` exists (a file the user made read-only to others stays so),
    else 0666 less the umask."""
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp")
    try:
        kept_mode: int | None = stat.S_IMODE(os.stat(target).st_mode)
    except OSError:  # none there, or a link that cannot be followed: the rename replaces it as before
        kept_mode = None
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            if kept_mode is not None:
                with contextlib.suppress(OSError):  # filesystems without permission bits (vfat, some FUSE)
                    os.fchmod(f.fileno(), kept_mode)
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(target.parent)


def _fsync_dir(d: Path) -> None:
    """Make a rename in ``d`` durable; a directory that cannot be opened or synced (EINVAL / ENOTSUP
    on some network and FUSE filesystems) is left as the filesystem keeps it."""
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def commit(root: str | os.PathLike, name: str) -> None:
    """Point ``root/LATEST`` at version folder ``name``, atomically and durably (rank 0 only)."""
    write_atomic(Path(root) / LATEST, name + "\n")


def named_by_latest(root: Path) -> str | None:
    """The name in ``root/LATEST`` as it is now, or None if there is none to read."""
    try:
        return (root / LATEST).read_text(errors="replace").strip()
    except OSError:
        return None


def discard(d: Path) -> None:
    """Remove version folder ``d``, which this process created for a save that failed. Refuses
    anything that is not a version folder (``shutil.rmtree`` itself never follows symlinks)."""
    if _is_version(d):
        shutil.rmtree(d)


def _own_meta(d: Path) -> dict | None:
    """``d``'s meta.json if ``d`` is a version folder of a readable format, else None."""
    if not _is_version(d):
        return None
    try:
        return read_meta(d)
    except (OSError, ValueError):
        return None


def retire(root: Path, newest: str, keep: int) -> list[str]:
    """Delete the versions on ``newest``'s ``parent`` chain past the ``keep`` newest (``newest``
    counting as one), except what ``LATEST`` names. Returns the names deleted. Rank 0 only, after
    the commit; a version that cannot be removed is reported with a warning (the save stands)."""
    chain: list[Path] = []
    name: Any = newest
    while isinstance(name, str) and NAME.fullmatch(name) and name not in {d.name for d in chain}:
        meta = _own_meta(root / name)
        if meta is None:
            break
        chain.append(root / name)
        name = meta.get("parent")
    current = named_by_latest(root)
    gone = []
    for d in chain[keep:]:
        if d.name == current:
            continue
        try:
            discard(d)
            gone.append(d.name)
        except OSError as exc:
            warnings.warn(
                f"checkpoint retention: could not remove {d} ({type(exc).__name__}: {exc}); it stays "
                f"and the next save retries",
                stacklevel=2,
            )
    return gone


def debris(root: Path, exclude: Iterable[str] = ()) -> list[str]:
    """Version-named folders in ``root`` without a ``meta.json``: left by saves that were killed,
    or being written right now by another run. Nothing removes them automatically."""
    skip = set(exclude)
    try:
        entries = list(root.iterdir())
    except OSError:
        return []
    return sorted(d.name for d in entries if d.name not in skip and _is_version(d) and not (d / META).exists())


def first_nonfinite(items: Iterable[tuple[str, Any]]) -> str | None:
    """The name of the first floating-point tensor in ``items`` (pairs name -> value, nested dicts and
    lists walked, DTensors checked on their local piece) holding NaN or inf; None if all are finite.
    One fused ``isfinite().all()`` per tensor; integer and bool tensors are skipped."""
    stack = list(items)[::-1]
    while stack:
        name, v = stack.pop()
        if isinstance(v, dict):
            stack.extend((f"{name}.{k}", x) for k, x in reversed(list(v.items())))
        elif isinstance(v, (list, tuple)):
            stack.extend((f"{name}.{i}", x) for i, x in reversed(list(enumerate(v))))
        elif isinstance(v, torch.Tensor):
            t = v.to_local() if hasattr(v, "to_local") else v
            if (t.is_floating_point() or t.is_complex()) and t.numel() and not bool(torch.isfinite(t).all()):
                return name
    return None
