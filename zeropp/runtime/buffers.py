"""ZeRO-R's constant-size communication buffers: one pool the stage-3 gathers and the gradient
reduce-scatters draw from, instead of a fresh ``torch.empty`` per collective.

Why: a fresh buffer per call makes the allocator's footprint follow the call pattern (and on
CUDA fragments the cache with a different size per unit); a pool sized once from the largest
unit and the prefetch depth keeps the communication memory a known constant that the memory
report can state (:attr:`BufferPool.nbytes`).

How: the pool holds *slots* (flat tensors of one dtype on one device). :meth:`acquire` hands out
a ``[numel]`` view of the smallest free slot that fits; :meth:`give_back` returns it. The pool
is preallocated for what the engine needs at once (see ``ZeroEngine``); if a rare pattern (a
block all ranks skip, whose gather stays in flight) needs more, a slot is added and counted in
:attr:`allocations`, so after the first step the count stays constant: a test checks exactly
that.

Reuse across streams: a slot is never freed to the caching allocator, so ``record_stream`` does
not apply; what makes reuse safe on CUDA is the order of the engine's calls: a slot is given
back only after the collective that reads or writes it was waited on the compute stream
(``Pending.wait``: the compute stream waits for the side stream's event), and every collective
that gets it next is issued after the compute stream's work so far (``streams.py``: the side
stream first waits for the compute stream). A slot given back before that wait could be handed
to the next collective while the first one still writes it.

Free slots are handed out smallest first and, among equal ones, the most recently given back
first (LIFO): a slot given back too early is the one reused next. In the streams debug mode
(``zeropp.comm.lifetime``) a given-back slot is poisoned (NaN), and on CPU poisoned again at
every completion point until it is handed out again, so such an early give-back shows up as a
wrong gradient or parameter instead of going unnoticed.
"""

from __future__ import annotations

import torch

from zeropp.comm import lifetime


class BufferPool:
    """Reusable flat buffers of ``dtype`` on ``device``, grouped by role (``"gather"``, ``"reduce"``)."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        self._slots: dict[str, list[torch.Tensor]] = {}  # role -> slots, each [capacity]
        self._sizes: dict[str, list[int]] = {}  # role -> capacity of each slot
        self._ptrs: dict[str, list[int]] = {}  # role -> storage pointer of each slot
        self._free: dict[str, list[int]] = {}  # role -> indices of free slots
        self._owner: dict[int, tuple[str, int]] = {}  # storage pointer -> (role, slot index) of slots in use
        self._cuts: dict[tuple[str, int, int], torch.Tensor] = {}  # (role, slot, numel) -> the slot's [numel] view
        # (id of a cut, id of a layout) -> (the cut, the layout, its views): see views()
        self._views: dict[tuple[int, int], tuple[torch.Tensor, tuple, list[torch.Tensor]]] = {}
        self.allocations = 0
        """Slots created so far (preallocated ones included): constant once the call pattern repeats."""

    def reserve(self, role: str, count: int, numel: int) -> None:
        """Preallocate ``count`` slots of ``numel`` elements for ``role``."""
        for _ in range(count):
            self._new_slot(role, numel)

    def _new_slot(self, role: str, numel: int) -> int:
        slots = self._slots.setdefault(role, [])
        slot = torch.empty(max(1, numel), dtype=self.dtype, device=self.device)  # [capacity]
        slots.append(slot)
        self._sizes.setdefault(role, []).append(slot.numel())
        self._ptrs.setdefault(role, []).append(slot.untyped_storage().data_ptr())
        self._free.setdefault(role, []).append(len(slots) - 1)
        self.allocations += 1
        return len(slots) - 1

    def free_slots(self, role: str, numel: int) -> int:
        """Free slots of ``role`` that can hold ``numel`` elements."""
        return sum(1 for k in self._free.get(role, []) if self._slots[role][k].numel() >= numel)

    def acquire(self, role: str, numel: int) -> torch.Tensor:
        """A ``[numel]`` view of a free slot of ``role`` (contents undefined); a new slot if none fits.
        The view of a slot for a given ``numel`` is made once and handed out again each time (the
        same tensor object), so :meth:`views` can reuse what it derived from it."""
        free, sizes = self._free.setdefault(role, []), self._sizes.setdefault(role, [])
        best = -1  # the smallest slot that fits; among equal ones the last given back (LIFO)
        for pos in range(len(free) - 1, -1, -1):
            n = sizes[free[pos]]
            if n >= numel and (best < 0 or n < sizes[free[best]]):
                best = pos
        k = free.pop(best) if best >= 0 else self._take_new(role, numel)
        buf = self._cuts.get((role, k, numel))
        if buf is None:
            buf = self._cuts[(role, k, numel)] = self._slots[role][k][:numel]
        self._owner[self._ptrs[role][k]] = (role, k)
        lifetime.reclaim(buf)
        return buf

    def _take_new(self, role: str, numel: int) -> int:
        """A new slot of ``numel`` elements for ``role``, already taken off the free list."""
        k = self._new_slot(role, numel)
        self._free[role].remove(k)
        return k

    def views(
        self, buf: torch.Tensor, layout: tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...]
    ) -> list[torch.Tensor]:
        """``buf.as_strided(shape, stride, storage offset + offset)`` per ``(shape, stride, offset)``
        of ``layout`` (a unit's parameter views, ``UnitLayout.views``). For a buffer :meth:`acquire`
        handed out they are made once per slot, ``numel`` and layout and returned again after
        (the pool keeps its slots, so they cost no memory): binding a gathered unit then makes
        no view, which is most of its host time. Any other buffer gets fresh views."""
        key = (id(buf), id(layout))
        hit = self._views.get(key)
        if hit is not None:
            return hit[2]
        base = buf.storage_offset()
        out = [buf.as_strided(shape, strides, base + offset) for shape, strides, offset in layout]
        owner = self._owner.get(buf.untyped_storage().data_ptr())
        if owner is not None and self._cuts.get((*owner, buf.numel())) is buf:
            self._views[key] = (buf, layout, out)  # holding both keeps their ids from being reused
        return out

    def give_back(self, buf: torch.Tensor | None) -> None:
        """Return a buffer from :meth:`acquire` (anything else, or a second return, is ignored)."""
        if buf is None:
            return
        owner = self._owner.pop(buf.untyped_storage().data_ptr(), None)
        if owner is not None:
            role, k = owner
            self._free[role].append(k)
            lifetime.retire(self._slots[role][k])  # debug mode: poisoned until handed out again

    @property
    def in_use(self) -> int:
        """Slots currently handed out."""
        return len(self._owner)

    @property
    def nbytes(self) -> int:
        """Bytes of all slots: the pool's constant footprint."""
        return sum(t.numel() * t.element_size() for slots in self._slots.values() for t in slots)

    def nbytes_by_role(self) -> dict[str, int]:
        """Bytes of the slots of each role."""
        return {r: sum(t.numel() * t.element_size() for t in s) for r, s in self._slots.items()}

    def __repr__(self) -> str:
        return (
            f"BufferPool({self.dtype}, {self.device}, slots={ {r: len(s) for r, s in self._slots.items()} }, "
            f"nbytes={self.nbytes})"
        )
