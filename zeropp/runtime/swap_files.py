"""The nvme tier's files and errors (``swap.py``'s :class:`~.swap.SwapSpace` owns them): a
preallocated :class:`SwapFile`, a :class:`Segment` of one, the :class:`SwapError` a failed
swap-file operation raises (naming the file, the offset and the cause), and the helpers the space
runs on its I/O threads and at its release."""

from __future__ import annotations

import errno
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["Segment", "SwapError", "SwapFile", "disk_hint", "release_files", "wait_all"]


class SwapError(RuntimeError):
    """A swap-file operation failed (disk full, I/O error); the message names the file."""

    def __init__(self, message: str, path: str, errno_: int | None) -> None:
        super().__init__(message)
        self.path = path
        """The swap file involved."""
        self.errno = errno_
        """The OS error number (``errno.ENOSPC`` for a full disk), when there was one."""


def disk_hint(err: int | None, directory: str) -> str:
    """What to do about a failed swap I/O of errno ``err`` under ``directory`` (a full disk named as such)."""
    if err == errno.ENOSPC:
        return f"the disk holding {directory} is full: free space there or point zero.nvme_path at a larger disk"
    return f"check the disk holding {directory} (zero.nvme_path)"


@dataclass(frozen=True)
class SwapFile:
    """One preallocated file of a :class:`SwapSpace`."""

    path: str
    nbytes: int
    fd: int


@dataclass(frozen=True)
class Segment:
    """``numel`` elements of ``dtype`` at byte ``offset`` of ``file``."""

    file: SwapFile
    offset: int
    numel: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty(0, dtype=self.dtype).element_size()


def release_files(pool: ThreadPoolExecutor, files: list[SwapFile], directory: str) -> None:
    """What ``SwapSpace.close`` frees (a function of the parts, not of the space, so that
    ``weakref.finalize`` can run it after the space is gone)."""
    pool.shutdown(wait=True)
    for f in files:
        try:
            os.close(f.fd)
        except OSError:
            pass
    files.clear()
    shutil.rmtree(directory, ignore_errors=True)


def wait_all(fs: Sequence[Future]) -> None:
    """Wait for every future, then raise the first failure (so no I/O is left running)."""
    first = None
    for f in fs:
        exc = f.exception()
        if exc is not None and first is None:
            first = exc
    if first is not None:
        raise first
