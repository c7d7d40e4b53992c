"""One output file at a path the user names (``--json FILE``, ``--plot FILE``): checked before any
work, written atomically, and never put over a file the command did not write.

A benchmark or study can run for minutes before it writes its file, so a path that cannot take it
(a directory, a directory that refuses new files, a file name the writer cannot encode) is refused
up front, when nothing has been measured yet, rather than as a traceback at the end that throws the
measurements away. A file already at the path is overwritten only when it is recognisably this
command's own output (``ours``: e.g. a JSON document of the command's shape); anything else there,
a user's notes or another tool's results, is refused untouched. The write itself goes through
:func:`zeropp.runtime.checkpoint_files.write_atomic`: a reader, or an interrupted run, sees the old
file or the new one, never half of it. A write that fails all the same (the disk filled, a quota,
the directory made read-only meanwhile) raises :class:`OutputWriteError`: one line naming the
file and why, which the commands print as ``error: ...`` instead of a traceback.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zeropp.runtime.checkpoint_files import write_atomic

__all__ = [
    "OutputFileError",
    "OutputWriteError",
    "check_output_file",
    "check_output_files",
    "creation_refused",
    "holds_tag",
    "json_file_is",
    "nearest_existing",
    "path_arg",
    "path_text_arg",
    "tag_markers",
    "tagged_png",
    "write_output_file",
]


class OutputFileError(ValueError):
    """A path an output file cannot be written to, in one line naming the flag and what to change."""


class OutputWriteError(OSError):
    """Writing an output file failed after the work (a full disk, a quota): the message names the
    file, the system's reason and that the file there was left as it was."""


def _nearest_existing(path: Path) -> Path:
    """``path``'s nearest ancestor that exists (the directory new folders would be created in)."""
    parent = path.parent
    while not (parent.exists() or parent.is_symlink()) and parent != parent.parent:
        parent = parent.parent
    return parent


def path_text_arg(text: str) -> str:
    """argparse type of a path flag: refuses an empty value (``--out ""``, often an unset shell
    variable), which as ``Path("")`` is the current directory, where files would land silently."""
    if not text.strip():
        import argparse

        raise argparse.ArgumentTypeError("an empty path; name a file or directory (an unset shell variable?)")
    return text


def path_arg(text: str) -> Path:
    """:func:`path_text_arg` as a ``Path``."""
    return Path(path_text_arg(text))


def creation_refused(directory: Path) -> OSError | None:
    """The error creating a file in ``directory`` raises (None when it can be done), tried for
    real with a temporary file removed at once: permission bits lie for root and on read-only
    mounts, and /proc or /sys refuse regardless."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".zeropp-", suffix=".probe", dir=directory)
    except OSError as err:
        return err
    os.close(fd)
    os.unlink(probe)
    return None


def nearest_existing(path: Path) -> Path:
    """``path`` itself when it exists, else its nearest ancestor that does (where a
    ``mkdir(parents=True)`` would start creating)."""
    return path if path.exists() or path.is_symlink() else _nearest_existing(path)


def check_output_file(
    path: Path, flag: str, *, ours: Callable[[Path], bool], create_parents: bool = False, suffix_hint: str = ".json"
) -> None:
    """Refuse (:class:`OutputFileError`) a ``path`` that :func:`write_output_file` could not write or
    should not overwrite: a directory; a missing parent directory (unless ``create_parents``: then
    its nearest existing ancestor must be a directory); a directory that refuses a new file (probed by
    creating and removing a temporary file there, which holds for root too, unlike mode bits); or an
    existing entry that is a symlink, not a regular file, or a file for which ``ours`` is False.
    ``flag`` is how the user named the path (``--json``); ``suffix_hint`` the file ending suggested
    when a directory was given."""
    if path.is_dir():
        raise OutputFileError(f"{flag} {path} is a directory; name a file, e.g. {path / ('out' + suffix_hint)}")
    parent = path.parent
    if not parent.is_dir():
        if parent.exists() or parent.is_symlink():
            raise OutputFileError(f"{flag} {path}: {parent} is not a directory; name a file in a directory")
        if not create_parents:
            raise OutputFileError(
                f"{flag} {path}: the directory {parent} does not exist; create it or name another file"
            )
        parent = _nearest_existing(path)
        if not parent.is_dir():
            raise OutputFileError(f"{flag} {path}: {parent} is not a directory; name a file in a directory")
    err = creation_refused(parent)
    if err is not None:
        raise OutputFileError(
            f"{flag} {path}: cannot write in {parent} ({err.strerror or err}); name a file in a writable directory"
        )
    if path.is_symlink() or (path.exists() and not (path.is_file() and ours(path))):
        raise OutputFileError(
            f"{flag} {path} exists and is not a file this command can tell it wrote (outputs of zeropp "
            "versions before 2026-11-26 carry no mark either); nothing was run and it is untouched: move it "
            "away or name a new file"
        )


def check_output_files(out: Path, flag: str, names: dict[str, Callable[[Path], bool]]) -> None:
    """:func:`check_output_file` for each file ``name`` -> its ``ours`` test that a command writes
    into the directory ``out`` (missing parents may be created)."""
    for name, ours in names.items():
        check_output_file(out / name, flag, ours=ours, create_parents=True, suffix_hint=Path(name).suffix)


def tagged_png(fig: Any, tag: str, **savefig: Any) -> bytes:
    """A matplotlib figure as PNG bytes whose ``Software`` text chunk is ``tag``: how a later run
    tells its own earlier plot (:func:`holds_tag`), which it may replace, from a user's image."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": tag}, **savefig)
    return buf.getvalue()


TAG_WINDOW = 1 << 16
"""Bytes read from each end of a file when looking for a tag: the metadata matplotlib writes sits
near the start (PNG text chunks before the image data, SVG metadata) or the end (the PDF Info
dictionary), so a large file at the path is never read whole."""


def tag_markers(tag: str) -> tuple[bytes, ...]:
    """How ``tag`` appears as the metadata field matplotlib writes it in: a PNG ``Software`` text
    chunk (:func:`tagged_png`), a PDF ``/Creator`` entry, an SVG creator's title."""
    t = tag.encode()
    png = (len(b"Software\x00") + len(t)).to_bytes(4, "big") + b"tEXtSoftware\x00" + t  # the chunk's own length
    return (png, b"/Creator (" + t + b")", b"<dc:title>" + t + b"</dc:title>")


def holds_tag(path: Path, tag: str) -> bool:
    """Whether the file ``path`` carries ``tag`` in a plot's metadata field (:func:`tag_markers`),
    looked for in its first and last :data:`TAG_WINDOW` bytes; a file merely containing the text
    elsewhere does not count."""
    try:
        with open(path, "rb") as f:
            head = f.read(TAG_WINDOW)
            size = f.seek(0, os.SEEK_END)
            f.seek(max(size - TAG_WINDOW, len(head)))
            tail = f.read(TAG_WINDOW)
    except OSError:
        return False
    return any(m in head or m in tail for m in tag_markers(tag))


def json_file_is(path: Path, shape: Callable[[Any], bool]) -> bool:
    """Whether ``path`` holds a JSON document for which ``shape`` is True (False when it cannot be
    read or parsed): the ``ours`` test of a command whose output is JSON of a known shape."""
    try:
        return bool(shape(json.loads(path.read_bytes())))
    except (OSError, ValueError):  # ValueError: not JSON, or not UTF-8
        return False


def write_output_file(path: Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` atomically, creating missing parent directories (the path was
    checked by :func:`check_output_file` before the work began); :class:`OutputWriteError` when
    the system refuses the write."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, data)
    except OSError as e:
        raise OutputWriteError(
            f"cannot write {path}: {e.strerror or e}; nothing was written there (an earlier file is as it was): "
            "free space or choose another path, and run again"
        ) from None
