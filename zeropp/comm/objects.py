"""Small JSON records exchanged between ranks, through the comm context.

Why not ``dist.all_gather_object``: it hands tensors it creates (and drops) to the backend outside
:meth:`zeropp.comm.context.CommContext.issue`, so when it is the last collective of a process (a
rank's final report), a gloo worker thread can be the one that frees their Python objects while
the interpreter is already finalizing, which aborts the process (``terminate called without an
active exception``) after a run that finished correctly; ``context.py`` says why. Here both
exchanges (the sizes, then the padded bytes) go through the context, which holds the tensors until
the backend released them and waits for that at exit. A second reason: the records are JSON, not
pickle, so nothing a peer sends can run code when it is read.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from .backend import backend_all_gather, exchange_device

__all__ = ["all_gather_json"]


def _device(group: dist.ProcessGroup | None, device: torch.device | None) -> torch.device:
    """The device the group's backend exchanges on: ``device`` if given, else CUDA for NCCL."""
    return device if device is not None else exchange_device(group)


def all_gather_json(obj: Any, group: dist.ProcessGroup | None = None, device: torch.device | None = None) -> list[Any]:
    """Every rank's ``obj`` of ``group``, in group-rank order. ``obj`` must be JSON-serializable
    (a ``TypeError`` says what is not); it comes back as ``json.loads`` reads it (tuples as lists,
    dict keys as strings). ``device``: where the exchange buffers live (default: CPU, or the
    current CUDA device when the group's backend is NCCL)."""
    world = dist.get_world_size(group)
    dev = _device(group, device)
    data = json.dumps(obj, separators=(",", ":")).encode()
    size = torch.tensor([len(data)], dtype=torch.int64, device=dev)  # [1]
    sizes = torch.empty(world, dtype=torch.int64, device=dev)  # [world]
    backend_all_gather(sizes, size, group, async_op=False)
    counts = sizes.tolist()
    width = max(counts)
    mine = torch.zeros(width, dtype=torch.uint8)  # [width], padded to the longest record
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = torch.empty(world * width, dtype=torch.uint8, device=dev)  # [world * width]
    backend_all_gather(gathered, mine.to(dev), group, async_op=False)
    rows = gathered.cpu().view(world, width)  # [world, width]
    return [json.loads(rows[r, : counts[r]].numpy().tobytes()) for r in range(world)]
