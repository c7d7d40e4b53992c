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
    and its accounting are the same as on a GPU and are tested on CPU ranks. With activation
    checkpointing, the only tensors saved inside a block are its inputs (the checkpoint saves
    them through these hooks, everything else is recomputed), so the offloaded set is exactly
    the checkpointed activations plus those of the layers outside the blocks.

  Own hooks rather than ``torch.autograd.graph.save_on_cpu`` because that one copies
  parameters too (wrong for stage 3, wasteful everywhere) and keeps no account of the bytes.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

TIERS = ("device", "host", "disk")


def _view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``t`` is a view of (torch's ``Tensor._base``), None when ``t`` is not a view."""
    return torch.Tensor._base.__get__(t)


def _version(t: torch.Tensor) -> int:
    """Torch's in-place modification counter of ``t`` (``Tensor._version``)."""
    return torch.Tensor._version.__get__(t)


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
            "activation_checkpointing=False (train.activation_checkpointing=false) or give the model its blocks")
    return BlockCheckpointing(blocks)


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
        self._peak = dict.fromkeys(TIERS, 0)
        self._device_storages: dict[int, int] = {}  # storage pointer -> bytes (this forward)
        # the same saved tensor twice -> one host copy; the weak reference proves the device tensor is
        # still alive (else its address may have been reused by another tensor)
        self._host_copies: dict[tuple, tuple[weakref.ref, torch.Tensor]] = {}
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
        are not counted (they are model states); on the device, a storage shared by several saved
        tensors counts once. The transient activations of one block's recomputation are not
        saved tensors and are not counted."""
        return dict(self._peak)

    # ------------------------------------------------------------------ hooks
    def _pack(self, t: torch.Tensor) -> tuple:
        base = _view_base(t)
        base = t if base is None else base
        if isinstance(base, nn.Parameter):
            if t is base:
                return ("param", base)
            return ("param_view", base, tuple(t.shape), t.stride(), t.storage_offset() - base.storage_offset())
        if not self.offload:
            self._device_storages.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            return ("device", t)
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, _version(t))
        hit = self._host_copies.get(key)
        host = hit[1] if hit is not None and hit[0]() is t else None
        if host is None:
            host = torch.empty(t.shape, dtype=t.dtype, layout=t.layout, pin_memory=self.pin)
            host.copy_(t, non_blocking=self.pin)  # [*t.shape]; pinned: ordered before later use on the stream
            self._host_copies[key] = (weakref.ref(t), host)
            self._host_bytes += host.numel() * host.element_size()
        return ("host", host, t.device)

    def _unpack(self, packed: tuple) -> torch.Tensor:
        kind = packed[0]
        if kind == "device":
            return packed[1]
        if kind == "host":
            _, host, device = packed
            return host.to(device, non_blocking=self.pin)
        p = packed[1]
        if p.numel() == 0 and not (kind == "param_view" and 0 in packed[2]):
            raise RuntimeError(
                "backward needs a parameter that is not gathered (stage 3 released it before its last use); "
                "a block's parameters must be used inside that block only")
        if kind == "param":
            return p
        _, _, shape, stride, rel = packed
        return p.detach().as_strided(shape, stride, p.storage_offset() + rel)
