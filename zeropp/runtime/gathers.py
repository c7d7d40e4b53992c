"""Stage 3's gathers and frees of flat units, and hpZ's secondary copies they keep and read.

A unit is ``free`` (only this rank's shard exists), ``inflight`` (its all-gather was issued into a
buffer of the engine's :class:`~.buffers.BufferPool`) or ``ready`` (the buffer is bound to the
module's parameters). :class:`UnitGathers` moves units between those states; *when* a unit is
gathered or freed is the hooks' business (``stage3.py``).

Where a gather comes from:

- a quantized frozen unit (MixZ++): its stored wire rows, over the world or, once hpZ holds its
  share of them, inside the node (``frozen.gather_quantized``);
- hpZ's secondary copy, inside the node: full-precision values (:meth:`UnitGathers.keep_secondary`,
  after a training forward) or qwZ's wire rows;
- otherwise this rank's shard (from the offload store when there is one) over the world.

hpZ with qwZ: a training forward's gather over the world keeps the wire rows it received
(``quantized_all_gather(wire_out=)``), and this rank's ``W / h`` of them become the unit's
secondary copy, still quantized. Every later gather of the step all-gathers those rows inside the
node and dequantizes them: the values the forward computed with, bit for bit, at a quarter of
the intra-node bytes and secondary memory of fp32 for INT8 (:meth:`UnitGathers.keeps_rows` says
when).

Weight differences (``ZeroConfig.weight_diff``, ``weight_diff.py``): when the first training
forward makes a unit's hpZ secondary, this rank's slice of the gathered buffer is kept as the
reference of its primary shard; the secondaries then persist across steps (the engine refreshes
them with quantized differences after each step), so every later gather, forward and backward,
comes from them, inside the node.
"""

from __future__ import annotations

from typing import Iterable

import torch

from zeropp.comm.codecs import codec_for
from zeropp.comm.kinds import CommKind
from zeropp.comm.spec import QuantSpec

from . import frozen as fz
from .buffers import BufferPool
from .collectives import EngineComm, Pending
from .config import ZeroConfig
from .partition import FlatUnit
from .plan_kinds import group_size_of
from .weight_diff import WeightDiff

GATHERED = ("sharded", "frozen")  # unit kinds whose full buffer exists only between a gather and its release


class UnitGathers:
    """Gathers, waits for and frees stage 3's units; keeps hpZ's secondary copies.

    ``frozen_spec``: how quantized frozen units are stored (``FrozenUnits.spec``).
    ``weight_diff``: qWD, which keeps the owner's reference when a secondary is made; the
    secondaries then persist across steps (refreshed by the engine).
    """

    def __init__(
        self,
        comm: EngineComm,
        *,
        config: ZeroConfig,
        pool: BufferPool,
        weight_diff: WeightDiff | None = None,
        frozen_spec: QuantSpec | None = None,
    ) -> None:
        self.comm, self.cfg, self.pool = comm, config, pool
        self.weight_diff = weight_diff
        self.frozen_spec = frozen_spec

    def gather(self, u: FlatUnit, *, backward: bool) -> None:
        """Issue the (async) gather of ``u`` unless it is already gathered or in flight."""
        if u.state != "free":
            return
        self.comm.run_deferred()  # a deferred forward check that fails raises before a buffer is taken
        buf = self.pool.acquire("gather", u.padded)  # [padded]
        kind = fz.KIND if u.kind == "frozen" else CommKind.BWD_ALL_GATHER if backward else CommKind.FWD_ALL_GATHER
        bucket = self.cfg.allgather_bucket_size
        work: Pending
        if fz.is_quantized(u):  # MixZ++: the stored wire rows, gathered as they are, dequantized into buf
            assert self.frozen_spec is not None  # (only a quantized frozen unit stores wire rows)
            work = fz.gather_quantized(self.comm, u, buf, self.frozen_spec, kind=kind, async_op=True, hpz=self.cfg.hpz)
        elif u.secondary is not None and u.secondary.dtype == torch.uint8:  # hpZ: the node holds qwZ's wire rows
            assert self.cfg.weights is not None  # (only qwZ keeps rows: keeps_rows)
            work = self.comm.all_gather_rows(
                buf, u.secondary, spec=self.cfg.weights, hpz=True, kind=kind, unit=u.name, async_op=True
            )
        elif u.secondary is not None:  # hpZ: the node already holds the whole block (at full precision)
            work = self.comm.all_gather(
                buf, u.secondary, spec=None, hpz=True, bucket=bucket, kind=kind, unit=u.name, async_op=True
            )
        else:
            store = u.extra.get("param_store")  # offload: the shard comes from host memory / disk
            shard = store.fetch(u) if store is not None else u.param_shard
            assert shard is not None  # (a sharded unit holds its shard, or its store does)
            rows = None
            if not backward and self.keeps_rows(u):  # [W * B]: qwZ's gathered wire rows, kept for hpZ
                rows = u.extra["rows"] = torch.empty(self.rows_bytes(u), dtype=torch.uint8, device=buf.device)
            work = self.comm.all_gather(
                buf, shard, spec=self.cfg.weights, bucket=bucket, kind=kind, unit=u.name, async_op=True, wire_out=rows
            )
        u.extra["buf"], u.work, u.state = buf, work, "inflight"

    def keeps_rows(self, u: FlatUnit) -> bool:
        """Whether a training forward keeps hpZ's secondary of ``u`` as qwZ's wire rows (this rank's
        ``W / h`` of the gathered rows, INT8/INT4) instead of full-precision values: with hpZ and
        qwZ, a trainable unit gathered in one call, no weight differences (which refresh
        full-precision secondaries). Later gathers then all-gather those rows
        inside the node and dequantize them: the same values bit for bit (the forward dequantized
        the very same rows), at the wire rows' bytes instead of the compute dtype's, both on the
        intra-node link and in memory."""
        return (
            self.cfg.hpz
            and self.cfg.weights is not None
            and self.weight_diff is None
            and u.kind == "sharded"
            and torch.is_grad_enabled()
            and self.comm.gathers_whole(u.shard_numel, bucket=self.cfg.allgather_bucket_size)
        )

    def rows_bytes(self, u: FlatUnit) -> int:
        """Bytes of the world's gathered wire rows of ``u`` (``W`` rows of one shard each)."""
        spec = self.cfg.weights
        assert spec is not None
        return self.comm.world_size * codec_for(spec).wire_bytes(
            u.shard_numel, spec.bits, group_size_of(spec, weights=True)
        )

    def ensure_ready(self, u: FlatUnit, *, backward: bool) -> None:
        """Make ``u``'s full parameters available in the module (waits for its gather)."""
        if u.state == "ready":
            return
        self.gather(u, backward=backward)
        _wait(u)
        buf = u.extra.pop("buf")
        u.bind(buf, self.pool.views(buf, u.layout.views))
        u.state = "ready"
        rows = u.extra.pop("rows", None)  # [W * B]: this gather's wire rows, kept for hpZ (keeps_rows)
        if rows is not None and u.secondary is None:
            u.secondary = self.comm.hpz_share(rows)  # [W / h * B]

    def ready_after_prefetch(self, group: list[FlatUnit], ahead: Iterable[list[FlatUnit]], *, backward: bool) -> None:
        """Make ``group`` ready, its gathers issued first (if not in flight yet), then the prefetches
        of the groups ``ahead``, and only then wait: the issue order is the one every rank uses
        (this block, then the next ones), but the next block's gather travels while this rank
        waits for this one instead of after it (one gather latency less per block when the
        gathers are latency-bound, as ZeRO++'s small quantized ones on a slow link are). The
        same buffers are live as when prefetching after the wait: ``group``'s and ``ahead``'s."""
        for u in group:
            self.gather(u, backward=backward)
        for g in ahead:
            for u in g:
                self.gather(u, backward=backward)
        for u in group:
            self.ensure_ready(u, backward=backward)

    def keep_secondary(self, u: FlatUnit) -> None:
        """hpZ, after a training forward: keep this rank's slice of the gathered ``u`` for the later
        gathers of the step (a quantized frozen unit keeps its slice of the quantized rows itself,
        in ``frozen.gather_quantized``). With weight differences the owner also keeps its reference."""
        if not self.cfg.hpz or u.secondary is not None or fz.is_quantized(u):
            return
        assert u.flat is not None  # (called while u is gathered)
        u.secondary = self.comm.hpz_share(u.flat)  # [padded / h]
        if self.weight_diff is not None and u.kind != "frozen":
            self.weight_diff.keep_reference(u)  # [S]: what the holders of this rank's shard got

    def release(self, u: FlatUnit) -> None:
        """Free ``u``'s full buffer (waiting first if a prefetch is still writing into it)."""
        if u.state == "inflight":
            _wait(u)
            self.pool.give_back(u.extra.pop("buf", None))
            u.extra.pop("rows", None)  # a prefetch never used: its rows are not kept
        if u.kind in GATHERED and (u.state != "free" or u.flat is not None):
            flat = u.flat
            u.release()
            self.pool.give_back(flat)


def _wait(u: FlatUnit) -> None:
    """Wait for ``u``'s gather in flight and drop its handle."""
    work = u.work
    assert isinstance(work, Pending)  # (every gather above returns one)
    work.wait()
    u.work = None
