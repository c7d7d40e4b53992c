"""ZeRO-R for activations: checkpointing each block, and where the saved activations live.

Two independent pieces, used by ``ZeroEngine`` and by the torch trainers alike:

- :func:`checkpoint_blocks` recomputes each block's activations in backward instead of keeping
  them, with torch's non-reentrant ``torch.utils.checkpoint``. It replaces the block's
  ``forward`` (an instance attribute), so the block's module hooks stay *outside* the
  checkpointed region: at stage 3 the forward pre/post hooks (gather, free) run once in forward
  and are not replayed by the recomputation, which instead finds the block already re-gathered
  by the stage-3 pre-backward step (``stage3.py``), which runs when the gradient reaches the
  block's output, i.e. before the recomputation is triggered. Parameter names are unchanged
  (no wrapper module), so checkpoints and ``named_parameters`` are the same with or without it.

- :class:`ActivationStore` is a ``saved_tensors_hooks`` pair installed around every training
  forward. It decides where each tensor autograd saves for backward lives, and counts the
  bytes per tier (:meth:`ActivationStore.memory_by_tier`):

  * parameters (or views of them) are never copied: the store keeps the ``Parameter`` and
    re-derives the view from its *current* binding when backward unpacks it. At stage 3 that
    is the re-gathered buffer, so the forward's gather buffer is not kept alive by a saved view
    (``linear`` saves ``weight.t()``, a view that would otherwise pin the whole forward buffer
    until backward) and the communication pool may reuse it;
  * other tensors (activations) stay on the device, or with ``offload=True`` are copied to host
    memory (pinned when the device is CUDA, so the copies are asynchronous) and brought back
    when backward needs them. A CPU engine copies too (into separate host tensors), so the path
    and its accounting are the same as on a GPU and are tested on CPU ranks. The copy is made per
    device *storage*, not per saved view: an attention block's SDPA output is saved by SDPA and,
    as a view, by the following linear, and ``q``/``k``/``v`` are three strided views of one
    ``qkv`` output; each such storage goes to the host once (see :class:`_StorageCopy` for when
    a span of the storage is copied and when a view alone is), so the host holds the bytes the
    device path would hold. With activation
    checkpointing, the only tensors saved inside a block are its inputs (the checkpoint saves
    them through these hooks, everything else is recomputed), so the offloaded set is exactly
    the checkpointed activations plus those of the layers outside the blocks.

  Own hooks rather than ``torch.autograd.graph.save_on_cpu`` because that one copies
  parameters too (wrong for stage 3, wasteful everywhere) and keeps no account of the bytes.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence, TypeGuard, cast

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from .choices import MemoryTier

TIERS = MemoryTier.values()


_BASE: Any = torch.Tensor._base
"""Torch's ``Tensor._base`` getter (a C getset descriptor; the stub declares a plain attribute):
read through it, a subclass's ``__torch_function__`` is not involved."""


def _view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``t`` is a view of (torch's ``Tensor._base``), None when ``t`` is not a view."""
    return _BASE.__get__(t)


def _version(t: torch.Tensor) -> int:
    """Torch's in-place modification counter of ``t`` (``Tensor._version``)."""
    return cast(Any, torch.Tensor._version).__get__(t)


class BlockCheckpointing:
    """Non-reentrant activation checkpointing around each of ``blocks``; :meth:`remove` undoes it."""

    def __init__(self, blocks: Sequence[nn.Module]) -> None:
        self.blocks = list(blocks)
        for blk in self.blocks:
            if "forward" in vars(blk):
                raise RuntimeError(f"{type(blk).__name__} already has an instance-level forward (checkpointed twice?)")
            blk.forward = _checkpointed(blk.forward)

    def remove(self) -> None:
        for blk in self.blocks:
            vars(blk).pop("forward", None)
        self.blocks.clear()


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing is saved, nothing to recompute
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def checkpoint_blocks(blocks: Sequence[nn.Module]) -> BlockCheckpointing:
    """Checkpoint every module of ``blocks`` (torch's non-reentrant ``torch.utils.checkpoint``);
    raises a ``ValueError`` naming the setting when there are none."""
    if not blocks:
        raise ValueError(
            "activation_checkpointing=True needs the model's transformer blocks (an nn.ModuleList, e.g. "
            "model.blocks, whose modules hold the trainable parameters); this model has none. Set "
            "activation_checkpointing=False (train.activation_checkpointing=false) or give the model its blocks"
        )
    return BlockCheckpointing(blocks)


_ALIGN = 16
"""Host spans start and end on multiples of this many bytes (within the storage), so a view of any
dtype sharing the storage (``view(dtype)``) starts at a whole element of the host copy."""


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """Bytes ``[lo, hi)`` of ``t``'s storage that ``t`` touches (torch strides are non-negative)."""
    size = t.element_size()
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))  # element offset of the last element
    lo = t.storage_offset() * size
    return int(lo), int(lo + (last + 1) * size)  # int() narrows torch's int | SymInt


class _HostSpan:
    """Host copy of bytes ``[start, start + host.numel())`` of one device storage, shared by every
    saved view it covers; ``device`` weakly remembers the last copy brought back, so views
    unpacked together in backward (``q``, ``k``, ``v`` by SDPA's backward) share one transfer."""

    __slots__ = ("device", "host", "start")

    def __init__(self, host: torch.Tensor, start: int) -> None:
        self.host = host  # [nbytes] uint8, pinned when the device is CUDA
        self.start = start
        self.device: weakref.ref | None = None


class _Saved:
    """One packed saved tensor: either its own compact host copy (``own``) or a strided window
    (shape, stride, byte offset, dtype) on a shared :class:`_HostSpan`. Mutable, so a view first
    copied on its own can be redirected to a span covering it (and its copy dropped)."""

    __slots__ = ("device", "dtype", "offset", "own", "shape", "span", "stride")

    def __init__(self, t: torch.Tensor) -> None:
        self.shape, self.stride = tuple(t.shape), t.stride()
        self.offset = t.storage_offset() * t.element_size()  # bytes into the device storage
        self.dtype, self.device = t.dtype, t.device
        self.own: torch.Tensor | None = None
        self.span: _HostSpan | None = None


class _StorageCopy:
    """Host copies of the views saved from one device storage at one version, in one forward.

    The rule (decided again at every new view, since what will be saved next is unknown):
    let ``U`` be the byte span from the lowest to the highest byte any saved view of the storage
    touches, and ``covered`` the bytes of the distinct saved views. When ``2 * covered >= |U|``
    the views cover their span reasonably and ``U`` (rounded out to ``_ALIGN`` bytes) is copied
    once, every view being rebuilt from it in backward; earlier copies (a smaller span, or views
    copied on their own) are dropped and their views redirected. Otherwise the new view is copied
    on its own (compactly), so a small view of a huge storage (one column, one row) never costs
    the storage. The host thus holds at most the storage's bytes, or the views' bytes when they
    are sparse: never a storage twice, and exactly the device path's count when the saved views
    cover their storage (an SDPA output saved whole and as a reshaped view; ``q``, ``k``, ``v``).
    """

    def __init__(self, t: torch.Tensor, holder: torch.Tensor) -> None:
        self.holder = weakref.ref(holder)  # alive => the storage is, and its address is not reused
        self.nbytes = t.untyped_storage().nbytes()
        self.views: dict[tuple, _Saved] = {}
        self.lo, self.hi, self.covered = self.nbytes, 0, 0
        self.span: _HostSpan | None = None

    def alive_for(self, t: torch.Tensor) -> bool:
        h = self.holder()
        st = t.untyped_storage()
        return h is not None and h.untyped_storage().data_ptr() == st.data_ptr() and self.nbytes == st.nbytes()

    def add(self, t: torch.Tensor, pin: bool) -> tuple[_Saved, int]:
        """The packed handle of view ``t`` and the change in host bytes its saving caused."""
        key = (t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        saved = self.views.get(key)
        if saved is not None:
            return saved, 0
        saved = self.views[key] = _Saved(t)
        if t.numel() == 0:  # no bytes, no span
            saved.own = torch.empty(t.shape, dtype=t.dtype)
            return saved, 0
        lo, hi = _byte_span(t)
        self.lo, self.hi = min(self.lo, lo), max(self.hi, hi)
        self.covered += t.numel() * t.element_size()
        span = self.span
        if span is not None and span.start <= lo and hi <= span.start + span.host.numel():
            saved.span = span
            return saved, 0
        if 2 * self.covered < self.hi - self.lo:  # sparse: this view alone
            saved.own = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            saved.own.copy_(t, non_blocking=pin)  # [*t.shape]; pinned: ordered before later use on the stream
            return saved, saved.own.numel() * saved.own.element_size()
        start = self.lo // _ALIGN * _ALIGN
        end = min(self.nbytes, -(-self.hi // _ALIGN) * _ALIGN)
        src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage(), start, (end - start,), (1,))
        host = torch.empty(end - start, dtype=torch.uint8, pin_memory=pin)
        host.copy_(src, non_blocking=pin)  # [end - start] bytes of the storage
        delta = host.numel() - (span.host.numel() if span is not None else 0)
        self.span = _HostSpan(host, start)
        for v in self.views.values():  # same storage, same version: the new span holds the same bytes
            if v.own is not None and v.own.numel() == 0:
                continue  # an empty view keeps its empty tensor (it has no place in the span)
            if v.own is not None:
                delta -= v.own.numel() * v.own.element_size()
            v.own, v.span = None, self.span
        return saved, delta


class ActivationStore:
    """Where saved activations live (device or pinned host) and how many bytes each tier held.

    Use ``with store.saving(): loss = model(...)`` around the forward; backward may run after the
    context is left (the packed tensors carry what they need).
    """

    def __init__(self, device: torch.device, *, offload: bool = False) -> None:
        self.device = torch.device(device)
        self.offload = offload
        """Copy activations to host memory (``zero.offload_activations``)."""
        self.pin = self.device.type == "cuda"
        self.storage_params: list[nn.Parameter] = []
        """Parameters whose saved aliases are found by storage, not by ``_base`` (tensor parallelism:
        the local tensors of DTensor ops on a split weight are aliases without a view base), so
        that backward reads them where stage 3 re-gathered the parameter, not the freed buffer."""
        self._peak = dict.fromkeys(TIERS, 0)
        self._device_storages: dict[int, int] = {}  # storage pointer -> bytes (this forward)
        # (storage pointer, version) -> its host copies; a view saved again, or another view of the
        # same storage, reuses them. The version (shared by a tensor and its views) makes a storage
        # modified in place after a save get fresh copies; the entry's weak reference proves the
        # storage is still alive (else its address may have been reused by another tensor).
        self._host_copies: dict[tuple[int, int], _StorageCopy] = {}
        self._host_bytes = 0

    # ------------------------------------------------------------------ public
    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Install the hooks for one forward and record its per-tier bytes on exit."""
        self._device_storages.clear()
        self._host_copies.clear()
        self._host_bytes = 0
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._peak = {"device": sum(self._device_storages.values()), "host": self._host_bytes, "disk": 0}
            self._device_storages.clear()
            self._host_copies.clear()  # the packed handles keep what backward needs

    def memory_by_tier(self) -> dict[str, int]:
        """Bytes of saved activations per tier (``device``, ``host``, ``disk``) at the end of the
        last forward, which is their peak (nothing saved is freed before backward). Parameters
        are not counted (they are model states); a storage shared by several saved tensors counts
        once on the device, and is copied once to the host (its saved span, or only the views
        when they are a small part of it: :class:`_StorageCopy`). The transient activations of
        one block's recomputation are not saved tensors and are not counted."""
        return dict(self._peak)

    # ------------------------------------------------------------------ hooks
    def _pack(self, t: torch.Tensor) -> tuple:
        if _is_dtensor(t):  # tensor parallelism: pack the local part (a parameter alias is re-resolved), rewrap later
            with torch.no_grad():
                local = t.to_local()
            return ("dtensor", self._pack(local), t.device_mesh, t.placements, t.shape, t.stride())
        base = _view_base(t)
        if base is None and self.storage_params:
            base = self._param_by_storage(t)
        base = t if base is None else base
        if _is_parameter(base):
            if t is base:
                return ("param", base)
            return ("param_view", base, tuple(t.shape), t.stride(), t.storage_offset() - base.storage_offset())
        if not self.offload:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self._device_storages:
                self._device_storages[ptr] = storage.nbytes()
            return ("device", t)
        with torch.no_grad():
            key = (t.untyped_storage().data_ptr(), _version(t))
            entry = self._host_copies.get(key)
            if entry is None or not entry.alive_for(t):
                entry = self._host_copies[key] = _StorageCopy(t, base)
            saved, delta = entry.add(t, self.pin)
        self._host_bytes += delta
        return ("host", saved)

    def _param_by_storage(self, t: torch.Tensor) -> nn.Parameter | None:
        """The parameter in :attr:`storage_params` whose elements ``t`` starts inside (same storage), or None."""
        if t.numel() == 0:
            return None
        ptr, off = t.untyped_storage().data_ptr(), t.storage_offset()
        for p in self.storage_params:
            if (
                p.numel()
                and p.untyped_storage().data_ptr() == ptr
                and p.storage_offset() <= off < p.storage_offset() + p.numel()
            ):
                return p
        return None

    def _unpack(self, packed: tuple) -> torch.Tensor:
        kind = packed[0]
        if kind == "device":
            return packed[1]
        if kind == "dtensor":
            from torch.distributed.tensor import DTensor

            _, inner, mesh, placements, shape, stride = packed
            with torch.no_grad():
                return DTensor.from_local(
                    self._unpack(inner), mesh, placements, run_check=False, shape=shape, stride=stride
                )
        if kind == "host":
            return self._from_host(packed[1])
        p = packed[1]
        if p.numel() == 0 and not (kind == "param_view" and 0 in packed[2]):
            raise RuntimeError(
                "backward needs a parameter that is not gathered (stage 3 released it before its last use); "
                "a block's parameters must be used inside that block only"
            )
        if kind == "param":
            return p
        _, _, shape, stride, rel = packed
        return p.detach().as_strided(shape, stride, p.storage_offset() + rel)

    def _from_host(self, saved: _Saved) -> torch.Tensor:
        """The saved tensor on its device: its own copy moved back, or its window (the saved
        shape, stride and offset) on the shared span moved back. The window is a view of the
        moved span, which therefore stays alive, and is reused, while any view rebuilt from it
        is: views unpacked together cost one transfer."""
        if saved.own is not None:
            return saved.own.to(saved.device, non_blocking=self.pin)
        span = saved.span
        assert span is not None, "a saved view has neither its own host copy nor a span"
        buf = span.device() if span.device is not None else None
        if buf is None:
            buf = span.host.to(saved.device, non_blocking=self.pin)  # [nbytes] uint8
            span.device = weakref.ref(buf)
        size = torch.empty(0, dtype=saved.dtype).element_size()
        offset = (saved.offset - span.start) // size  # elements into the span (_ALIGN keeps it whole)
        if buf.numel() % size == 0:
            return buf.view(saved.dtype).as_strided(saved.shape, saved.stride, offset)
        out = torch.empty(0, dtype=saved.dtype, device=buf.device)  # a span ending mid-element of this dtype
        return out.set_(buf.untyped_storage(), offset, saved.shape, saved.stride)


def _is_parameter(t: torch.Tensor) -> bool:
    """``isinstance(t, nn.Parameter)``, without the Python-level ``__instancecheck__`` of its
    metaclass for the two common types: a ``Parameter`` is one, and a plain ``torch.Tensor`` is
    one exactly when it carries torch's ``_is_param`` flag (what that check looks at)."""
    cls = type(t)
    if cls is nn.Parameter:
        return True
    if cls is torch.Tensor:
        return bool(getattr(t, "_is_param", False))
    return isinstance(t, nn.Parameter)


def _is_dtensor(t: torch.Tensor) -> TypeGuard[DTensor]:
    """A ``torch.distributed.tensor.DTensor`` (tensor parallelism), without importing it when unused."""
    if type(t) is torch.Tensor or type(t) is nn.Parameter:
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)
