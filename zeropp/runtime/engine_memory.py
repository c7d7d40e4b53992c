"""The memory side of ``ZeroEngine``: what a rank holds, by category and tier, and the buffer pool's size.

``memory_report`` counts the model state (parameters, gradients, optimizer, hpZ copies) at the
end of the last step's backward; ``memory_phases`` snapshots every category by tier after each
phase of construction and of the last step (``memory.PHASES``), with the phase's peak; other
holders of bytes (an offloaded parameter store, swap buffers, qgZ residuals, saved activations)
report themselves through ``track_memory``. The gather / reduce-scatter pool is sized here too,
from what the stage keeps in flight at once.
"""

from __future__ import annotations

from . import memory as mem
from .buffers import BufferPool
from .engine_parts import EngineParts
from .memory import measure_memory
from .reduction import REDUCE_INFLIGHT


class EngineMemory(EngineParts):
    """``ZeroEngine``'s memory accounting (see the module docstring)."""

    def memory_report(self) -> dict[str, int]:
        """Bytes of parameters, gradients, optimizer states and hpZ secondary copies this rank
        holds (measured at the end of the last step's backward; from the buffers if no step yet)."""
        return dict(self._last_memory) if self._last_memory is not None else self._measure_memory()

    def memory_phases(self) -> dict[str, mem.MemorySnapshot]:
        """This rank's memory by tier and category after model creation and optimizer creation
        (both inside the constructor) and, from the last step, after its (last micro-batch's)
        forward, backward and optimizer step, each with the phase's peak
        (``zeropp.runtime.memory.MemorySnapshot``; what each phase holds: ``memory.PHASES``). Local, cheap."""
        return dict(self._phases)

    def track_memory(self, category: str, source: object) -> None:
        """Count ``source``'s bytes under ``category`` (one of ``memory.CATEGORIES``) in
        :meth:`memory_phases`: it must have ``memory_by_tier() -> {"device"|"host"|"disk": int}``
        or ``nbytes`` (device bytes). A ``params`` source (offloaded parameter store) reports the
        sharded units' parameter shards itself, so the engine stops counting them."""
        if category not in self._memory_sources:
            raise ValueError(f"track_memory: category {category!r} is not one of {mem.CATEGORIES}")
        mem.source_tiers(source)  # fails now, naming the object, if it cannot report
        self._memory_sources[category].append(source)

    def _measure_memory(self) -> dict[str, int]:
        return measure_memory(self.units + self.frozen_units, self.optim.nbytes())

    def _record_phase(self, phase: str) -> None:
        """Snapshot memory at the end of ``phase`` and start the next phase's peak."""
        sources = self._memory_sources
        if phase != "forward":  # saved activations live from a forward to its backward only
            sources = {**sources, "activations": []}
        self._phases[phase] = mem.snapshot(phase, self.units + self.frozen_units, sources, self.device)
        mem.reset_peak(self.device)

    def _make_buffer_pool(self) -> BufferPool:
        """The gather / reduce-scatter pool, preallocated for what is in use at once: at stage 3 the
        root, the running block and ``prefetch_depth`` prefetched blocks (a block is freed before
        the next but ``prefetch_depth`` one is gathered, in forward and in backward); the
        reduce-scatters of stages 2-3 keep at most ``REDUCE_INFLIGHT`` in flight (an older one is
        waited for before the next is sent, in the same order on every rank; their output buffers
        only from a step's second micro-step on: the first writes the gradient shards); stage 1 reduces
        one unit at a time. Collectives larger than a bucket are chunked inside ``EngineComm``."""
        pool = BufferPool(self.dtype, self.device)
        gathered = [u for u in self.units if u.kind == "sharded"]
        # distinct units (coalesced blocks share one); never more at once than there are
        block_units = list(dict.fromkeys(u for _, u in self.blocks if u.kind == "sharded"))
        frozen_blocks = list(dict.fromkeys(u for _, u in self.frozen.blocks))
        if gathered:
            if self.root is not None and self.root.kind == "sharded":
                pool.reserve("gather", 1, self.root.padded)
            if block_units:
                live = min(self.cfg.prefetch_depth + 1, len(block_units))
                pool.reserve("gather", live, max(u.padded for u in block_units))
        if self.frozen.root is not None:  # frozen units are gathered next to their block's (same schedule)
            pool.reserve("gather", 1, self.frozen.root.padded)
        if frozen_blocks:
            live = min(self.cfg.prefetch_depth + 1, len(frozen_blocks))
            pool.reserve("gather", live, max(u.padded for u in frozen_blocks))
        reduced = [u for u in self.units if u.kind != "replicated"]
        if reduced:
            inflight = min(REDUCE_INFLIGHT if self.cfg.stage >= 2 else 1, len(reduced))
            pool.reserve("grad_flat", inflight, max(u.padded for u in reduced))
            if self.cfg.stage >= 2 and self.cfg.grad_accum_steps > 1:  # (the first micro-step needs none)
                pool.reserve("grad_shard", inflight, max(u.shard_numel for u in reduced))
        return pool
