"""State that ``torch.distributed.checkpoint`` (DCP) saves and loads piece by piece, where it lives.

DCP takes a state dict of tensors and, for a load, copies what it reads into them. That asks for
every tensor at once: for state kept in a file (the nvme tier's swap file) it would mean the
rank's whole optimizer state in host memory for a save, and a second copy of it for a load. Both
DCP planners have the hooks to avoid that, used here:

- a save calls ``SavePlanner.resolve_data`` for one item when it writes that item:
  :class:`StreamingSavePlanner` produces the tensor of a key listed in its ``sources`` there, so a
  file-backed state is read one piece (one state of one unit) at a time, and frees it once written
  (DCP's writer would otherwise keep every tensor it wrote until the rank's file is closed; the
  same goes for the host copies it makes of device tensors, which the planner makes instead);
- a load calls ``LoadPlanner.resolve_tensor`` for the destination of each piece it reads and
  ``commit_tensor`` once it is filled: :class:`InPlaceLoadPlanner` hands out a host buffer of the
  piece's size for a key listed in its ``sinks`` and writes it where the state lives on commit.

The state dict holds a :func:`placeholder` for those keys: shape and dtype, no data. (Not a
``meta`` tensor: DCP's load planner replaces meta tensors by empty ones on the default process
group's device, which on NCCL is the GPU.) Tensors that live in memory (device or host) are put in
the state dict as views of the live state; DCP reads them and loads into them in place.

Hand-written because DCP has no streaming source or sink of its own: these are its planner
extension points (``resolve_data``, ``resolve_tensor``, ``commit_tensor``) and a writer option
(:func:`storage_writer`), nothing else changed. Measured on CPU (tests/distributed/test_runtime_checkpoint_tiers.py):
a save's transient host memory is one piece (DTensor's planning index of a sharded piece, int64,
is twice its bytes), a load's three pieces (the file's record, its decoded tensor, the sink's buffer).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Collection, Mapping

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import ReadItem, WriteItem

from .checkpoint_safe import SafeLoadPlanner

Source = Callable[[], torch.Tensor]
"""Produces one key's local tensor when DCP writes it: a fresh host tensor nobody else holds, with
a resizable storage (not one handed to numpy), which the save frees once written."""
Sink = Callable[[int, torch.Tensor], None]
"""``sink(offset, piece)`` stores a filled piece at element ``offset`` of one key's local tensor."""


def placeholder(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A CPU tensor of shape ``[numel]`` and ``dtype`` holding no data of its own (one element,
    expanded): what a state dict holds for a key whose data a planner produces or consumes.
    Anything that tried to copy into it would fail (its elements overlap) instead of losing data."""
    return torch.zeros(1, dtype=dtype).expand(numel)


def finite(t: torch.Tensor) -> bool:
    """Whether ``t`` holds no NaN or inf, with no temporary of its size (``torch.isfinite`` makes
    three: this runs on a piece whose memory the save bounds). Min and max propagate NaN, and are
    finite exactly when every element is."""
    if not t.is_floating_point() or not t.numel():
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def diverged(name: str) -> ValueError:
    """The error of a save whose value ``name`` holds NaN or inf."""
    return ValueError(
        f"{name} holds NaN or inf values: the training state has diverged and a checkpoint of it would "
        f"not resume; it was not saved. Resume from the last good checkpoint (with a lower learning "
        f"rate, or another seed)"
    )


class StreamingSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, except that the host copy of each tensor it writes lives only
    until the next one is produced, so a rank's save holds one tensor's host copy at a time:

    - the tensor of a key in ``sources`` is produced by ``sources[key]()`` (a fresh host tensor)
      when it is written, and checked finite then (a placeholder holds nothing to check before);
    - a tensor DCP would copy to write it (on a device, or a view of a larger storage, such as a
      shard's unpadded piece) is copied here instead.

    Either copy is freed (its storage resized to zero) when the next tensor is produced: DCP's
    writer keeps a reference to every tensor it wrote until the rank's file is closed (torch 2.13,
    ``_write_files_from_queue``), which would otherwise hold the rank's whole optimizer state in
    host memory. Valid only with a writer that writes each tensor before it asks for the next:
    :func:`storage_writer`'s (no copy-ahead)."""

    def __init__(self, sources: Mapping[str, Source]) -> None:
        super().__init__()
        self.sources = dict(sources)
        self._copy: torch.Tensor | None = None
        """The last tensor produced here (freed when the next one is)."""

    def resolve_data(self, write_item: WriteItem) -> Any:
        source = self.sources.get(write_item.index.fqn)
        if source is None:
            t = super().resolve_data(write_item)
            if not isinstance(t, torch.Tensor) or (t.device.type == "cpu" and t.untyped_storage().nbytes() == t.nbytes):
                return t  # written from where it lives: no copy
            self._release()
            t = t.to("cpu", copy=True, memory_format=torch.contiguous_format)
        else:
            self._release()
            t = source()
            if not finite(t):
                raise diverged(write_item.index.fqn)
        self._copy = t
        return t

    def _release(self) -> None:
        if self._copy is not None:
            self._copy.untyped_storage().resize_(0)
            self._copy = None


def storage_writer(d: str | os.PathLike) -> FileSystemWriter:
    """The DCP writer of one version folder: one file per rank, fsynced, and no copy-ahead
    (``per_thread_copy_ahead=0``: on a CUDA machine DCP would otherwise resolve several tensors
    before writing the first, which :class:`StreamingSavePlanner` would free too early)."""
    return FileSystemWriter(d, single_file_per_rank=True, sync_files=True, thread_count=1, per_thread_copy_ahead=0)


class InPlaceLoadPlanner(SafeLoadPlanner):
    """:class:`checkpoint_safe.SafeLoadPlanner` (non-tensor values read as plain data only) that
    stores the pieces of a key in ``sinks`` through ``sinks[key](offset, piece)`` (``offset``: in
    the key's local tensor), using one host buffer per piece. :attr:`touched` records whether any
    key of ``live`` (the ones whose tensors are the live state, written in place, and the sinks)
    has received data: a failure after that has changed the state."""

    def __init__(self, sinks: Mapping[str, Sink], live: Collection[str]) -> None:
        super().__init__()
        self.sinks = dict(sinks)
        self.live = frozenset(live) | frozenset(self.sinks)
        self.touched = False

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        fqn = read_item.dest_index.fqn
        if fqn in self.live:
            self.touched = True
        if fqn not in self.sinks:
            return super().resolve_tensor(read_item)
        (n,) = read_item.lengths  # the states are 1-D
        dtype = self.lookup_tensor(read_item.dest_index).dtype
        return torch.empty(int(n), dtype=dtype)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        sink = self.sinks.get(read_item.dest_index.fqn)
        if sink is not None:
            (offset,) = read_item.dest_offsets
            sink(int(offset), tensor)
