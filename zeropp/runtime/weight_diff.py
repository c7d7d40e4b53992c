"""qWD: refresh the weights every rank holds by sending quantized *differences* (SDP4Bit).

After an optimizer step the ranks must learn each other's updated shards. ZeRO sends the weights
themselves (stages 1-2: the parameter all-gather; stage 3 with hpZ: the next forward's global
gather, whose result becomes hpZ's secondary copy). Quantizing those weights to 4 bits costs
accuracy at every step. ``ZeroConfig.weight_diff`` sends instead, for each shard,
``q(new shard - what the receivers hold of it)``, and every rank adds the dequantized differences
to what it holds. Two properties follow:

- all holders stay identical: every rank, the owner included, adds the same dequantized values
  (the owner's own row comes back through the gather, already dequantized);
- the rounding error does not accumulate: the next difference is taken against the weights the
  ranks actually hold, so what a difference failed to deliver is sent again with the next one.
  The held weights are always within one difference's rounding error of the fp32 masters, and
  a difference (one step's update plus the previous rounding error) is small, so its 4-bit
  error is far smaller than that of 4-bit weights.

Stages 1-2 (:meth:`WeightDiff.refresh_replica`): every rank holds the full compute-dtype weights
in ``u.flat``, so "what the receivers hold" of this rank's shard is ``u.flat[shard range]``. The
fp32 master must then be a separate copy (the engine does not alias it to ``u.flat`` here).

Stage 3 with hpZ (:meth:`WeightDiff.refresh_secondary`): hpZ's secondary copies (``u.secondary``,
this rank's ``1 / hpz_size`` slice of the unit, made by ``gathers.UnitGathers`` from the first training
forward's global gather) persist across steps. The receivers of this rank's primary shard are
the ranks whose secondary slice covers it, generally on other nodes, so the owner keeps a
*reference* (:meth:`keep_reference`): its slice of that same first gathered buffer, in the
compute dtype, exactly what the receivers hold of its shard. After the step one global
all-gather carries ``q(new shard - reference)`` from every rank; each rank adds the rows of its
secondary slice to ``u.secondary`` and the owner adds its own row to its reference. The forward
and backward gathers of later steps come from the secondaries (inside the node): the cross-node
weight traffic of a step is one quantized-difference gather.

A load (or any :meth:`ZeroEngine.refresh_params`) re-sends the weights whole (stages 1-2) or
drops the secondaries and references (stage 3; the next training forward gathers globally and
rebuilds both), so the held weights restart exact from the loaded masters. A resumed run thus
holds the exact weights where an uninterrupted one holds weights within one difference's
rounding error of them: equal up to that error, not bit for bit.

Bytes: the differences travel as one quantized all-gather per unit (kind :data:`KIND`), counted
by ``zeropp.comm`` like any other message: ``codec.wire_bytes(S, bits, group_size)`` to each
other rank of the world per unit and step (default group size: the weights' 512).
"""

from __future__ import annotations

from typing import Callable

import torch

from zeropp.comm.kinds import CommKind
from zeropp.comm.spec import QuantSpec

from .collectives import EngineComm, Pending
from .partition import FlatUnit

KIND = CommKind.WEIGHT_DIFF_ALL_GATHER
"""``CommStats`` kind of the quantized-difference all-gathers."""


class _Applied:
    """An in-flight difference gather and the additions to make once it has landed."""

    def __init__(self, work: Pending, apply: Callable[[], None]) -> None:
        self._work, self._apply, self.done = work, apply, False

    def wait(self) -> None:
        if self.done:
            return
        self._work.wait()
        self._apply()
        self.done = True
        self._work = self._apply = None  # type: ignore[assignment]  # drop the receive buffer now


class WeightDiff:
    """The weight-difference refresh of one engine (``ZeroConfig.weight_diff``).

    Holds the stage-3 references (one ``[S]`` compute-dtype tensor per unit whose hpZ secondary
    exists) and issues the difference all-gathers. At most one gather is in flight: issuing the
    next one finishes the previous one first, so the fp32 receive buffers never add up to a full
    model copy.
    """

    def __init__(
        self, spec: QuantSpec, comm: EngineComm, *, dtype: torch.dtype, device: torch.device, bucket: int
    ) -> None:
        self.spec, self.comm, self.dtype, self.device, self.bucket = spec, comm, dtype, device, bucket
        self._refs: dict[int, torch.Tensor] = {}  # id(unit) -> [S] compute dtype (stage 3)
        self._inflight: _Applied | None = None

    # ------------------------------------------------------------------ stage 3 references
    def keep_reference(self, u: FlatUnit) -> None:
        """Stage 3, when hpZ's secondary of ``u`` is made from a gathered ``u.flat``: keep this rank's
        primary-shard slice of that buffer, which is what the receivers of the shard now hold."""
        a, b = u.shard_range()
        self._refs[id(u)] = u.flat[a:b].detach().clone()  # [S] compute dtype

    def reference(self, u: FlatUnit) -> torch.Tensor | None:
        """This rank's reference of ``u`` (what the ranks hold of its shard), or None."""
        return self._refs.get(id(u))

    def drop(self, u: FlatUnit) -> None:
        """Forget ``u``'s reference (its secondary is being dropped too)."""
        self._refs.pop(id(u), None)

    def reset(self) -> None:
        """Forget every reference and finish the gather in flight."""
        self.finish()
        self._refs.clear()

    # ------------------------------------------------------------------ refreshes
    def refresh_replica(self, u: FlatUnit, master: torch.Tensor) -> _Applied:
        """Stages 1-2: send ``q(master - u.flat[own shard])`` to every rank; on :meth:`_Applied.wait`
        every rank adds the dequantized differences of all shards to ``u.flat`` ([padded])."""
        a, b = u.shard_range()
        diff = master.float() - u.flat[a:b].float()  # [S] fp32

        def apply(buf: torch.Tensor) -> None:
            u.flat.add_(buf.to(u.flat.dtype))  # [padded]

        return self._issue(diff, u, apply)

    def refresh_secondary(self, u: FlatUnit, master: torch.Tensor) -> _Applied:
        """Stage 3: send ``q(master - reference)`` to every rank; on :meth:`_Applied.wait` each rank
        adds the rows of its secondary slice to ``u.secondary`` and its own row to its reference.
        ``u`` must have a secondary and a reference (``has_secondary``)."""
        ref = self._refs[id(u)]
        a, b = u.shard_range()
        h, k = self.comm.hpz_size, self.comm.hpz_rank
        diff = master.float() - ref.float()  # [S] fp32

        def apply(buf: torch.Tensor) -> None:
            u.secondary.add_(buf.view(h, -1)[k].to(u.secondary.dtype))  # [padded / h]
            ref.add_(buf[a:b].to(ref.dtype))  # [S]

        return self._issue(diff, u, apply)

    def has_secondary(self, u: FlatUnit) -> bool:
        """True when ``u``'s secondary and reference both exist (made in a training forward)."""
        return u.secondary is not None and id(u) in self._refs

    def finish(self) -> None:
        """Wait for the gather in flight (if any) and apply it."""
        if self._inflight is not None:
            self._inflight.wait()
            self._inflight = None

    def _issue(self, diff: torch.Tensor, u: FlatUnit, apply: Callable[[torch.Tensor], None]) -> _Applied:
        self.finish()
        buf = torch.empty(u.padded, dtype=torch.float32, device=diff.device)  # [padded] dequantized differences
        work = self.comm.all_gather(
            buf, diff, spec=self.spec, bucket=self.bucket, kind=KIND, unit=u.name, async_op=True
        )
        self._inflight = _Applied(work, lambda: apply(buf))
        return self._inflight

    # ------------------------------------------------------------------ accounting
    def memory_by_tier(self) -> dict[str, int]:
        """Bytes of the stage-3 references, on the engine's device."""
        n = sum(r.numel() * r.element_size() for r in self._refs.values())
        return {"device": n, "host": 0, "disk": 0}

    @staticmethod
    def bytes_per_rank(shard_numels: list[int], spec: QuantSpec) -> int:
        """Bytes one rank sends to *each* other rank in one refresh of units with these shard sizes
        (one unbucketed quantized all-gather per unit): the formula the tests check ``CommStats`` against."""
        from zeropp.comm.codecs import codec_for
        from zeropp.kernels import DEFAULT_WEIGHT_GROUP_SIZE

        gs = DEFAULT_WEIGHT_GROUP_SIZE if spec.group_size is None else spec.group_size
        codec = codec_for(spec)
        return sum(codec.wire_bytes(s, spec.bits, gs) for s in shard_numels if s)
