"""How long a communication buffer lives, and the debug mode that checks it.

The rule: a buffer zeropp allocates for a collective (wire rows, receive buffers, dtype or
chunk temporaries) is released only by the party that uses it last, and only once that party
has been ordered after the work that reads or writes it. :class:`Buffers` is that release.

- **CUDA**: a tensor returns to the caching allocator's pool of the stream it was *allocated*
  on, and the allocator hands the block to that stream's next allocation at once. Under NCCL
  an ``async_op=True`` collective keeps its tensors alive only until ``work.wait()`` (torch >=
  2.7 stashes them on the host instead of calling ``record_stream``), and ``wait()`` orders
  only the *calling* stream after the collective. So a buffer allocated on the caller's stream
  and waited on another one (qgZ's hop-1 rows, waited on the chain's side stream; a handle
  waited on a stream other than the issuer's) could be overwritten by the caller's next kernel
  while the collective or the continuation still reads it. :meth:`Buffers.release` therefore
  calls ``tensor.record_stream(current stream)`` before dropping the reference: at the free,
  the allocator records an event on every stream recorded for the block and reuses it only
  once those events have completed, i.e. once the releasing stream has passed everything
  enqueued on it so far. Holding Python references until some later ``wait()`` alone would not
  do: whatever stream that ``wait()`` runs on, the free still goes to the allocating stream.
  ``record_stream`` on the allocating stream itself is a no-op for the allocator.
- **CPU (gloo)**: the "streams" are threads (the caller, the comm worker, gloo's threads), the
  allocator frees nothing that is referenced, and ``context.issue`` keeps what gloo holds; the
  release only drops our reference, after the thread that used the buffer last is done with it.

Who releases: a handle (``backend.CommHandle``) at the end of its ``wait()``, after the local
post-processing read the receive buffer; a continuation's buffers (``chain.submit(...,
buffers=)``) right after the continuation ran, on its side stream (CUDA) or the comm worker
(CPU); the engine's ``Pending`` after its chunks completed. Tensors the caller owns (a
collective's input and output) are never released as ours: :class:`Buffers` takes them as
``protect`` (never poisoned; a codec may return a view of its input) and ``borrowed`` (used on
another stream, so the allocator must wait for that stream when the caller frees them).

Debug mode (``ZEROPP_DEBUG_STREAMS=1``, read once per process when its comm context is
created; see :func:`debug_enabled`): a buffer released too early must show up as a wrong result, also on
CPU where nothing is really reused. So

- every released buffer is **poisoned** (NaN for floating dtypes, all bits set for integer
  ones: 0xFF bytes) when zeropp releases it: :meth:`Buffers.release`, and the engine's pool
  when a slot is given back (:func:`retire`);
- on CPU a released buffer still alive (someone kept a reference: the bug) is poisoned again at
  every later completion point (:func:`completed`: a handle's works waited, a continuation's
  hop landed), the way an allocator would have handed its memory to new work meanwhile, until
  it is freed or a pool hands it out again (:func:`reclaim`); host order is execution order
  there. On CUDA only the release poisons (on the releasing stream, so only work on *other*
  streams that still uses the buffer sees it), because a later poison on an unrelated stream
  would race with the buffer's legitimate next user;
- the chain runs continuations late (``context.CommContext``: the comm worker waits for the
  caller's next submission or ``wait()``; CUDA: the side stream first spins), so a continuation
  that reads a buffer the caller released at issue reads the poison.
"""

from __future__ import annotations

import threading
import weakref
from typing import Iterable, Optional

import torch

from . import context

__all__ = ["Buffers", "completed", "debug_enabled", "poison", "reclaim", "retire"]

_UNSIGNED = (torch.uint8, torch.uint16, torch.uint32, torch.uint64)
_REGISTRY_LOCK = threading.Lock()
_RELEASED: list[weakref.ref] = []  # CPU tensors released (poisoned) in debug mode, while alive


def debug_enabled() -> bool:
    """Whether the streams debug mode is on (this process's comm context; ``ZEROPP_DEBUG_STREAMS``)."""
    return context.current().debug_streams


def poison(t: torch.Tensor) -> None:
    """Overwrite ``t`` in place with values no collective produces: NaN (floating / complex),
    all bits set (integers: 0xFF bytes; bool: True). On CUDA on the current stream."""
    if t.numel() == 0:
        return
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    elif t.dtype in _UNSIGNED:
        t.fill_(torch.iinfo(t.dtype).max)
    else:
        t.fill_(-1)  # two's complement: every bit set


def _storage_key(t: torch.Tensor) -> tuple[torch.device, int]:
    return t.device, t.untyped_storage().data_ptr()


def _aliases(t: torch.Tensor, others: Iterable[torch.Tensor]) -> bool:
    key = _storage_key(t)
    return any(o is not None and o.numel() and _storage_key(o) == key for o in others)


def _register(t: torch.Tensor) -> None:
    """Debug mode, CPU: remember a released buffer so :func:`completed` poisons it again while alive."""
    if t.device.type != "cpu" or t.numel() == 0:
        return
    with _REGISTRY_LOCK:
        _RELEASED[:] = [r for r in _RELEASED if r() is not None]
        _RELEASED.append(weakref.ref(t))


def completed() -> None:
    """A wait returned (work completed). Debug mode: every CPU buffer released earlier and still
    alive is poisoned again now, as reused memory would have been overwritten by new work. No-op
    otherwise."""
    if not debug_enabled():
        return
    with _REGISTRY_LOCK:  # held while poisoning: reclaim() cannot hand a slot out half-way
        alive = []
        for r in _RELEASED:
            t = r()
            if t is not None:
                poison(t)
                alive.append(r)
        _RELEASED[:] = alive


def retire(t: Optional[torch.Tensor]) -> None:
    """A pooled buffer was given back (``runtime.buffers.BufferPool``). Debug mode: poison it (and,
    on CPU, keep poisoning it at completion points until :func:`reclaim` hands it out again).
    A pool slot is never freed to the allocator, so no ``record_stream``: the pool's users give a
    slot back only after waiting, on the stream that reuses it, for the collective that used it."""
    if t is None or not debug_enabled():
        return
    poison(t)
    _register(t)


def reclaim(t: torch.Tensor) -> None:
    """A pool hands ``t``'s memory out again: stop poisoning it (its new user owns it now)."""
    if not _RELEASED:
        return
    key = _storage_key(t)
    with _REGISTRY_LOCK:
        _RELEASED[:] = [r for r in _RELEASED if (u := r()) is not None and _storage_key(u) != key]


class Buffers:
    """The communication buffers of one collective (or continuation) that zeropp allocated, held
    until :meth:`release`. ``protect``: the caller's tensors (input, output); a buffer sharing
    storage with one of them is held but never poisoned. ``borrowed`` tensors (the caller's) are
    only marked as used by the releasing stream (CUDA), never poisoned."""

    def __init__(
        self,
        *tensors: Optional[torch.Tensor],
        protect: Iterable[Optional[torch.Tensor]] = (),
        borrowed: Iterable[Optional[torch.Tensor]] = (),
    ) -> None:
        self._owned: list[torch.Tensor] = []
        self._borrowed = [t for t in borrowed if t is not None]
        self._protect = [t for t in protect if t is not None]
        self.add(*tensors)

    def add(self, *tensors: Optional[torch.Tensor]) -> None:
        """Hold more buffers of ours (None is skipped)."""
        self._owned.extend(t for t in tensors if t is not None)

    def __len__(self) -> int:
        return len(self._owned) + len(self._borrowed)

    def release(self) -> None:
        """The current stream (CUDA) / thread (CPU) is the last user and has been ordered after the
        work on these buffers: mark them used by the current stream (CUDA: the allocator reuses
        them only after it), poison ours in debug mode, drop every reference. Idempotent."""
        owned, borrowed, self._owned, self._borrowed = self._owned, self._borrowed, [], []
        debug = debug_enabled() and bool(owned)
        for t in owned + borrowed:
            if t.device.type == "cuda" and t.numel():  # an empty tensor has no block to mark
                t.record_stream(torch.cuda.current_stream(t.device))
        if debug:
            for t in owned:
                if not _aliases(t, self._protect + borrowed):
                    poison(t)
                    _register(t)
        self._protect = []
