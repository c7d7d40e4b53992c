"""How the nvme tier's reads copy a chunk out of a staging buffer (``swap.py``): blocking copies on
the host, or ``non_blocking=True`` copies from pinned buffers on a CUDA stream with an event per
chunk, so that the next disk read into that buffer waits for that copy only."""

from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = ["HOST_COPIES", "Copies", "CudaCopies", "HostCopies"]


class Copies(Protocol):
    """How ``SwapSpace`` copies a chunk out of a staging buffer when it reads through them."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """Copy ``src`` (a staging-buffer view) into ``dst``; returns None when done, else a fence
        whose ``synchronize()`` returns once ``src`` has been read."""
        ...

    def finish(self, out: torch.Tensor) -> None:
        """After the last chunk: make ``out`` safe to use where the caller works."""
        ...


class HostCopies:
    """Blocking copies (the destination on the CPU, or unpinned buffers): nothing to fence."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def finish(self, out: torch.Tensor) -> None:
        pass


HOST_COPIES = HostCopies()


class CudaCopies:
    """``non_blocking=True`` copies from pinned buffers on ``stream``, an event after each. With
    ``side`` (``stream`` is not the current stream) :meth:`finish` makes the current stream wait
    for the copies on the device and records the result's use there for the caching allocator."""

    def __init__(self, stream: torch.cuda.Stream, *, side: bool) -> None:
        self.stream, self.side = stream, side

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event:
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return ev

    def finish(self, out: torch.Tensor) -> None:
        if self.side:
            current = torch.cuda.current_stream(out.device)
            current.wait_stream(self.stream)
            out.record_stream(current)
