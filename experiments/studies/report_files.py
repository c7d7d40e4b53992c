"""Where ``python -m experiments.report`` writes, and proof of which files there it wrote.

The report writes fixed names (``report.md`` and the figures) into a sweep directory or ``--out``,
directories that also hold files of their own (notes, a figure drawn by hand). So it overwrites a
file only when it can show the file is its own: :data:`MANIFEST`, written beside the outputs, lists
each file a report wrote with its size and sha256, and a file counts as the report's only while it
is listed *and* its content still matches (a report the user edited by hand is theirs now). Any
other file in the way refuses the whole report before anything is written (:class:`ReportError`,
naming the files). A manifest that is not one (bad JSON, wrong shape) is not trusted at all.

Each file is written atomically (a temporary file in the same directory, then ``os.replace``), so
an interrupted report leaves every file whole, old or new. The manifest is written first listing
both the old and the new content of every file, then the files, then the manifest with the new
content only: whatever point a report stops at, every file it left is still provably its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from zeropp.runtime.checkpoint_files import write_atomic

__all__ = ["MANIFEST", "ReportError", "Written", "check_outputs", "write_outputs"]

MANIFEST = "report-manifest.json"
"""The file beside the outputs that lists what a report wrote (JSON, see :func:`_manifest_text`)."""
FORMAT = "zeropp-report-manifest/1"
"""The manifest's ``format`` value: a JSON file without it is not a report's manifest."""


class ReportError(ValueError):
    """Bad input to the report (a run file, ``--out``, a file in the way): one line saying what to
    change. The command prints it as ``error: ...`` and exits with status 2."""


@dataclass(frozen=True)
class Written:
    """One file a report wrote: its name in the output directory, size in bytes and sha256 (hex)."""

    name: str
    size: int
    sha256: str

    @classmethod
    def of(cls, name: str, data: bytes) -> Written:
        return cls(name, len(data), hashlib.sha256(data).hexdigest())


def _read_manifest(out: Path, flag: str = "--out") -> list[Written]:
    """The entries of ``out``'s manifest ([] when there is none); :class:`ReportError` when the file
    is there but is not a manifest a report wrote (so it is not overwritten either)."""
    path = out / MANIFEST
    if not (path.exists() or path.is_symlink()):
        return []
    why = "not a regular file"
    if path.is_file() and not path.is_symlink():
        try:
            doc = json.loads(path.read_bytes())
            why = _manifest_problem(doc)
        except (OSError, ValueError) as e:  # ValueError: bad JSON or bad UTF-8
            why = f"unreadable: {e}"
        if not why:
            return [Written(f["name"], f["size"], f["sha256"]) for f in doc["files"]]
    raise ReportError(
        f"{path} is not a manifest written by a report ({why}), so this command cannot tell its own files "
        f"from yours in {out}; move {MANIFEST} away, or choose another {flag}"
    )


def _manifest_problem(doc: object) -> str:
    """What makes ``doc`` (parsed JSON) not a manifest; empty when it is one."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        return f'no "format": "{FORMAT}"'
    files = doc.get("files")
    if not isinstance(files, list):
        return '"files" is not a list'
    for f in files:
        if not (
            isinstance(f, dict)
            and isinstance(f.get("name"), str)
            and f["name"] not in ("", ".", "..")
            and f["name"] == Path(f["name"]).name  # a bare file name: nothing outside the directory
            and type(f.get("size")) is int
            and isinstance(f.get("sha256"), str)
            and len(f["sha256"]) == 64
        ):
            return f'"files" holds {json.dumps(f)[:80]}, not a {{"name", "size", "sha256"}} entry'
    return ""


def _is_ours(path: Path, listed: Iterable[Written]) -> bool:
    """``path`` is a regular file (not a link) whose size and sha256 match an entry of its name."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return True  # absent: nothing to lose
    entries = [w for w in listed if w.name == path.name and w.size == st.st_size]
    if not stat.S_ISREG(st.st_mode) or not entries:
        return False
    try:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return False
    return any(w.sha256 == digest for w in entries)


def check_outputs(out: Path, names: Iterable[str], flag: str = "--out") -> list[Written]:
    """Refuse (:class:`ReportError`) unless the report may write ``names`` and its manifest into
    ``out``: ``out`` is a directory or absent, and each of those files is absent or provably
    written by an earlier report. Returns the earlier manifest's entries whose files still match.
    ``flag``: how the command's user names ``out`` (``--out``, ``out=``), in the messages. Every
    command writing fixed names into a directory that may hold the user's files uses this rule
    (the report, ``experiments.formats``, ``experiments.memory_study``, ``experiments.converge``)."""
    if (out.exists() or out.is_symlink()) and not out.is_dir():
        raise ReportError(f"{flag} {out} exists and is not a directory; choose a directory (new or existing)")
    if not out.exists():
        return []
    listed = _read_manifest(out, flag)
    foreign = [n for n in names if n != MANIFEST and not _is_ours(out / n, listed)]
    if foreign:
        raise ReportError(
            f"{out} holds {', '.join(foreign)}, which this command would overwrite but cannot tell it wrote "
            f"(not in {MANIFEST}, or changed since; outputs of zeropp versions before 2026-11-26 have no "
            f"{MANIFEST}); nothing was written: move them away, or choose another {flag}"
        )
    return [w for w in listed if (out / w.name).exists() and _is_ours(out / w.name, [w])]


def _manifest_text(entries: Iterable[Written]) -> bytes:
    files = [{"name": w.name, "size": w.size, "sha256": w.sha256} for w in entries]
    return (json.dumps({"format": FORMAT, "files": files}, indent=2) + "\n").encode()


def write_outputs(out: Path, contents: Mapping[str, bytes], flag: str = "--out") -> list[Path]:
    """Write ``contents`` (file name -> bytes) into ``out`` and record them in its manifest, after
    :func:`check_outputs` (so nothing is written when any file in the way is not the report's).
    Earlier entries whose files are left as they were stay listed. Returns the written paths."""
    kept = check_outputs(out, contents, flag)
    new = [Written.of(name, data) for name, data in contents.items()]
    others = [w for w in kept if w.name not in contents]
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / MANIFEST, _manifest_text(kept + new))  # old or new: either counts as ours
        for name, data in contents.items():
            write_atomic(out / name, data)
        write_atomic(out / MANIFEST, _manifest_text(others + new))
    except OSError as e:
        raise ReportError(f"cannot write into {out}: {e}; choose a writable {flag}") from None
    return [out / name for name in contents]
