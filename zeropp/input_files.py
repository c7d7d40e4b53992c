"""Small files a command is pointed at (a calibrated cluster file, a run's ``summary.json`` and
``metrics.jsonl``, a sweep job's ``failed.json``), read only when they are regular files of a
bounded size.

Reading a path blindly hangs on a FIFO (a read waits for a writer forever), never ends on
``/dev/zero`` and exhausts memory on a huge file, whatever the name says; a mistyped path, a
symlink left behind or a scratch pipe is enough to meet one. :func:`read_regular` opens without
blocking, looks at what it opened, and refuses anything but a regular file of at most ``limit``
bytes with an ``OSError`` whose text says what the path is. :func:`parse_json` and
:func:`read_json` parse such bytes as JSON (only parsed: nothing in them runs), turning the
``RecursionError`` of a deeply nested document (``[[[[...`` a few thousand deep) into the
``ValueError`` of any other malformed JSON, which every reader reports in one line.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from typing import Any

__all__ = ["MAX_BYTES", "DuplicateKeyError", "parse_json", "read_head", "read_json", "read_regular"]

MAX_BYTES = 256 << 20
"""The largest such file read (256 MiB): far above any summary or cluster file, well below memory."""


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _open_regular(path: str | os.PathLike[str]) -> tuple[int, os.stat_result]:
    """A descriptor of ``path`` and its stat, or ``OSError`` when it is not a regular file."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens at once instead of waiting for a writer
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"is {_kind(st.st_mode)}, not a regular file", str(path))
    return fd, st


def read_head(path: str | os.PathLike[str], length: int, offset: int = 0) -> tuple[bytes, int]:
    """Up to ``length`` bytes of ``path`` from ``offset`` and the file's size: a header of a
    large file (a safetensors weights file) read without reading the file, with the same
    refusals as :func:`read_regular`."""
    fd, st = _open_regular(path)
    try:
        return os.pread(fd, max(0, min(length, st.st_size - offset)), offset), st.st_size
    finally:
        os.close(fd)


def read_regular(path: str | os.PathLike[str], limit: int = MAX_BYTES) -> bytes:
    """The bytes of ``path`` (symlinks followed), or ``OSError`` when it is missing, unreadable,
    not a regular file (``strerror``: "is a FIFO (named pipe), not a regular file") or larger
    than ``limit`` bytes."""
    fd, st = _open_regular(path)
    try:
        if st.st_size > limit:
            raise OSError(errno.EFBIG, f"holds {st.st_size:,} bytes, more than the {limit:,} read here", str(path))
        chunks, left = [], limit + 1
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:  # it grew while being read
            raise OSError(errno.EFBIG, f"holds more than the {limit:,} bytes read here", str(path))
        return data
    finally:
        os.close(fd)


class DuplicateKeyError(ValueError):
    """A JSON object names one key twice: ``json.loads`` keeps the last value and drops the other
    without a word, so a file where that matters is refused (``unique_keys=True``)."""


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise DuplicateKeyError(f"the key {key!r} is given twice in one object, and JSON keeps only the last")
        seen.add(key)
    return dict(pairs)


def parse_json(data: bytes | str, *, unique_keys: bool = False) -> Any:
    """``json.loads(data)``, with a document nested too deeply for the parser (a crafted or corrupt
    file) raised as ``ValueError`` like any other malformed JSON, not as ``RecursionError``.
    ``unique_keys``: an object naming a key twice raises :class:`DuplicateKeyError` (a ValueError)."""
    try:
        return json.loads(data, object_pairs_hook=_unique_pairs if unique_keys else None)
    except RecursionError:
        raise ValueError("nested too deeply to be parsed (a corrupt or crafted file)") from None


def read_json(path: str | os.PathLike[str], limit: int = MAX_BYTES, *, unique_keys: bool = False) -> Any:
    """:func:`parse_json` of :func:`read_regular` (``OSError`` / ``ValueError`` as those raise)."""
    return parse_json(read_regular(path, limit), unique_keys=unique_keys)
