"""Counting the tensor values the library reads back to the host.

On a GPU every such read (``t.item()``, ``t.tolist()``, ``float(t)``, ``if t:`` ...) waits for
every kernel queued before it, so the host cannot run ahead of the GPU. On CPU there is no queue
to wait for, but the reads are the same calls: :func:`host_reads` records each one made by the
library's own code (a frame in ``zeropp/`` or ``kernels/``; torch's internals are not counted),
with the function that made it and the tensor's device, so a test can assert how many a training
step makes without a GPU.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from typing import Iterator

import torch

import zeropp
import zeropp.kernels

READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")
"""The ``torch.Tensor`` methods that hand a tensor's values to Python. (``numpy()`` is not one:
it refuses a device tensor, so it never waits for a GPU; the swap tier's I/O threads use it to
hand host buffers to ``os.preadv``.)"""

ROOTS = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (zeropp, zeropp.kernels))
"""The library's source folders (``zeropp.kernels`` lives in ``kernels/``)."""


@dataclass(frozen=True)
class HostRead:
    """One read of a tensor's values by library code."""

    where: str
    """``file:function`` of the frame that read, the file relative to the repository (``zeropp/runtime/update.py``)."""
    how: str
    """The method (``tolist``, ``__float__`` ...)."""
    device: str
    """The read tensor's device type (``cpu``, ``cuda``)."""


@contextlib.contextmanager
def host_reads() -> Iterator[list[HostRead]]:
    """Within the block, every :data:`READS` call whose caller is library code is appended to the
    yielded list (the calls still run). The methods are restored on exit."""
    found: list[HostRead] = []
    saved = {name: torch.Tensor.__dict__.get(name) for name in READS}

    def counted(name: str, original):
        def read(self, *args, **kwargs):
            frame = sys._getframe(1)
            path = os.path.abspath(frame.f_code.co_filename)
            root = next((r for r in ROOTS if path.startswith(r)), None)
            if root is not None:
                rel = os.path.relpath(path, os.path.dirname(root.rstrip(os.sep)))
                found.append(HostRead(f"{rel}:{frame.f_code.co_name}", name, self.device.type))
            return original(self, *args, **kwargs)

        return read

    for name in READS:
        setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    try:
        yield found
    finally:
        for name, original in saved.items():
            if original is None:
                delattr(torch.Tensor, name)  # it was inherited from torch._C.TensorBase
            else:
                setattr(torch.Tensor, name, original)
