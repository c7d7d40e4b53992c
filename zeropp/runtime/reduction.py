"""The gradient side of one engine: reduce every unit's gradient over the data-parallel ranks.

Stages 2 and 3 reduce-scatter a unit's (block's) gradient as soon as the last of its parameters
has its gradient (post-accumulate-grad hooks), *on every micro-step*, into a sharded gradient
buffer (``FlatUnit.grad_shard``: the step's first micro-step writes it, later ones add into it),
so full gradients never outlive one block's backward. Writing the first result in place needs no
zero-fill of the shards and leaves nothing of an aborted step (a forward that raised in a later
micro-step) in the next step's gradient. The reduce-scatters are issued in one fixed order on every rank (blocks last to first,
then the root): a unit that is ready early waits for the units before it, and at the end of
backward the units that got no (or partial) gradient are sent with zeros for the missing parts.
So a parameter or block that is unused on some ranks only still gets the right averaged
gradient, instead of the ranks' collectives pairing up out of order. At stage 3 the waiting
units are also sent when the backward of the block before them starts (the point where they can
get no more gradient; ``Stage3Hooks`` calls :meth:`GradReducer.flush_reductions_before`), so each
reduce-scatter sits at the same place among the backward gathers on every rank. At most
:data:`REDUCE_INFLIGHT` reduce-scatters are in flight; an older one is waited for (and added
into its shard) before the next is sent. A gradient that arrives after its unit was sent would
be lost: it is recorded, and after the last backward every rank raises the same error before the
optimizer step (:meth:`GradReducer.late_grads`).

Stages 0 and 1 let autograd accumulate full gradients locally and reduce once after the last
micro-step (all-reduce at stage 0, reduce-scatter at stage 1; :meth:`GradReducer.final_grads`),
which is what their memory budget allows. Replicated units (small parameters kept whole) are
all-reduced there at every stage.

qgZ: with ``ZeroConfig.grads`` every reduce-scatter is quantized, and with its ``error_feedback``
the residuals live in one ``zeropp.comm.ErrorFeedback`` owned here (:attr:`GradReducer.error_feedback`;
the engine saves it in checkpoints and counts its bytes). With ``offload_optimizer=cpu`` each
unit's final gradient is handed to ``land(unit_index, grad)`` as soon as it is reduced, so the
copy to the host overlaps the rest of backward.
"""

from __future__ import annotations

from typing import Callable, Sequence, cast

import torch
import torch.distributed as dist
from torch import nn

from zeropp.comm.kinds import CommKind

from .buffers import BufferPool
from .collectives import EngineComm, Pending
from .config import ZeroConfig
from .partition import FlatUnit

REDUCE_INFLIGHT = 2
"""Stages 2-3: gradient reduce-scatters in flight at once (each holds one ``[padded]`` input and one
``[S]`` output buffer of the pool); two lets one unit's reduction overlap the next unit's backward."""


def reduces_when_ready(stage: int, u: FlatUnit) -> bool:
    """Whether ``u``'s gradient is reduce-scattered during backward (stages 2-3, non-replicated
    units) rather than once after the last micro-step."""
    return stage >= 2 and u.kind != "replicated"


def make_error_feedback(cfg: ZeroConfig) -> object | None:
    """qgZ residuals (``zeropp.comm.ErrorFeedback``) when ``cfg.grads.error_feedback``, else None."""
    if cfg.grads is None or not cfg.grads.error_feedback:
        return None
    from zeropp.comm import ErrorFeedback

    return ErrorFeedback.for_spec(cfg.grads)


class GradReducer:
    """Owns the reduction of one engine's gradients: the fixed reduce order, the reduce-scatters
    in flight, the late-gradient record and the qgZ error feedback.

    ``units`` are the engine's trainable units (their order is the optimizer's), ``blocks`` and
    ``root`` give the backward order, ``pool`` lends the ``grad_flat`` / ``grad_shard`` buffers,
    ``all_ranks`` is the size of the default group (the late-gradient check runs over it),
    ``land`` is the offloaded optimizer's ``land_grad`` (or None) and ``release`` frees a
    stage-3 unit's gathered parameters once its gradient is flattened (None below stage 3).
    Construction registers one post-accumulate-grad hook per parameter of every unit reduced
    during backward; :meth:`close` removes them.
    """

    def __init__(
        self,
        units: Sequence[FlatUnit],
        blocks: Sequence[tuple[nn.Module, FlatUnit]],
        root: FlatUnit | None,
        comm: EngineComm,
        *,
        config: ZeroConfig,
        pool: BufferPool,
        dtype: torch.dtype,
        device: torch.device,
        all_ranks: int,
        land: Callable[[int, torch.Tensor], None] | None = None,
        release: Callable[[FlatUnit], None] | None = None,
        control: dist.ProcessGroup | None = None,
    ) -> None:
        self.units = list(units)
        self.control = control
        """The group of :meth:`raise_late_grads`' host exchange (``batch.control_group``; None: the default group)."""
        self.cfg, self.comm, self.pool = config, comm, pool
        self.dtype, self.device, self.all_ranks = dtype, device, all_ranks
        self.land, self.release = land, release
        self.error_feedback = make_error_feedback(config)
        """qgZ error-feedback residuals (``zeropp.comm.ErrorFeedback``) or None."""
        self._unit_index = {id(u): i for i, u in enumerate(self.units)}
        self._last_micro = False  # in the last micro-step's backward: reductions finishing now are final
        self._grad_hooks = [
            p.register_post_accumulate_grad_hook(self._grad_hook(u))
            for u in self.units
            if self.reduces_when_ready(u)
            for p in u.params
        ]
        self._pending: list[tuple[object, FlatUnit, torch.Tensor]] = []  # reduce-scatters in flight: work, unit, out
        # the one order in which every rank issues the gradient reduce-scatters (backward order)
        order = list(dict.fromkeys(u for _, u in reversed(blocks)))  # (coalesced blocks share a unit)
        order += [root] if root is not None else []
        order += [u for u in self.units if u not in order]
        self.reduce_order: list[FlatUnit] = [u for u in order if self.reduces_when_ready(u)]
        """The units reduced during backward, in the order every rank sends them."""
        self._reduce_pos = {id(u): k for k, u in enumerate(self.reduce_order)}
        self._next_reduce = 0  # position in reduce_order of the next unit to send
        self._late: list[str] = []  # gradients that arrived after their unit was sent (see late_grads)
        self._overwrite = True  # the step's first backward: reduce-scatters land in the gradient shards directly

    def reduces_when_ready(self, u: FlatUnit) -> bool:
        """Whether ``u`` is reduce-scattered during backward (see :func:`reduces_when_ready`)."""
        return reduces_when_ready(self.cfg.stage, u)

    # ------------------------------------------------------------------ step and micro-step
    def start_step(self) -> None:
        """Forget the late gradients of a previous step and any gradient of a step abandoned after
        a backward (a forward that raised in a later micro-step): the parameters' ``.grad`` that
        autograd accumulates (stages 0-1, replicated units) are dropped, and the first micro-step's
        reduce-scatters write the gradient shards themselves (:meth:`_reduce_unit`)."""
        self._late.clear()
        self._overwrite = True
        for u in self.units:
            for p in u.params:
                p.grad = None

    def start_micro_step(self, last: bool) -> None:
        """Before a micro-step's forward: no unit has a gradient or was sent yet. ``last``: the
        step's last micro-step, whose reductions are final (landed on the host when offloaded)."""
        for u in self.units:
            u.grads_ready, u.reduced = 0, False
            u.extra["ready"] = False
        self._next_reduce = 0
        self._last_micro = last

    def _grad_hook(self, u: FlatUnit):
        n = len(u.slots)

        def hook(p: torch.Tensor) -> None:
            if u.reduced:  # recorded, not raised here: raising on this rank only would hang the others
                self._late.append(f"{u.param_name(p)} ({u.name})")
                return
            u.grads_ready += 1
            if u.grads_ready == n:
                u.extra["ready"] = True
                self._issue_ready()

        return hook

    def late_grads(self) -> int:
        """Stages 2-3, after the last backward: how many gradients arrived on this rank after their
        unit's reduce-scatter was sent (stage 3: a block's parameter used in another block's
        backward, or blocks running in forward in another order than the policy lists them). Such
        a gradient would be lost, so the optimizer step sums this count over the ranks in the
        all-reduce it makes anyway (``update.ParamUpdate.read_totals``) and, when it is not 0 on
        some rank, calls :meth:`raise_late_grads` on every rank before anything is updated."""
        return len(self._late) if self.reduce_order else 0

    def raise_late_grads(self) -> None:
        """Collective over the default group's ranks, called on every rank once the summed
        :meth:`late_grads` is not 0: drop this step's gradients and raise the same error on every
        rank, naming each rank's late gradients. The collectives up to here were the same on
        every rank."""
        found: list = [None] * self.all_ranks
        if self.all_ranks > 1:
            dist.all_gather_object(found, sorted(set(self._late)), group=self.control)
        else:
            found[0] = sorted(set(self._late))
        for u in self.units:
            for p in u.params:
                p.grad = None
            if u.grad_shard is not None:
                u.grad_shard.zero_()
        what = "; ".join(f"rank {r}: {', '.join(names)}" for r, names in enumerate(found) if names)
        raise RuntimeError(
            f"gradients arrived after their unit's gradient was sent ({what}); no step was taken. At stage "
            f"{self.cfg.stage} a block's parameters must get all their gradient during that block's backward: do not "
            f"use one block's parameters inside another block (register a shared parameter in both: it is then kept "
            f"in the root unit), and run the blocks in forward in the order the block policy lists them"
        )

    # ------------------------------------------------------------------ stages 2-3: during backward
    def _issue_ready(self) -> None:
        """Send the ready units that are next in the fixed order (the same order on every rank)."""
        order = self.reduce_order
        while self._next_reduce < len(order) and order[self._next_reduce].extra.get("ready"):
            self._reduce_unit(order[self._next_reduce])
            self._next_reduce += 1

    def flush_reductions_before(self, u: FlatUnit) -> None:
        """Stage 3, when ``u``'s backward starts: the units before ``u`` in the fixed order (the
        blocks after it) have had all the gradient they will get in this micro-step, so send the
        ones still waiting (a parameter unused on this rank only) now, in order. Every rank thus
        issues each reduce-scatter at the same point relative to the backward gathers."""
        pos = self._reduce_pos.get(id(u))
        if pos is None:
            return
        order = self.reduce_order
        while self._next_reduce < pos:
            self._reduce_unit(order[self._next_reduce])
            self._next_reduce += 1

    def _reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor, u: FlatUnit, *, async_op: bool) -> Pending:
        """``u``'s gradient reduce-scatter: ``flat`` ([padded]) averaged over the world, this rank's
        part into ``out`` ([S]); quantized (qgZ, with its error feedback) when the config says so."""
        return self.comm.reduce_scatter(
            out,
            flat,
            key=u.name,
            bucket=self.cfg.reduce_bucket_size,
            kind=CommKind.GRAD_REDUCE_SCATTER,
            unit=u.name,
            async_op=async_op,
            spec=self.cfg.grads,
            error_feedback=self.error_feedback,
        )

    def _reduce_unit(self, u: FlatUnit) -> None:
        """Stages 2/3: send this micro-step's gradient of ``u`` (async); free ``u`` at stage 3."""
        if u.reduced:
            return
        self.comm.run_deferred()  # a deferred forward check that fails raises before any state or buffer changes
        u.reduced = True
        while len(self._pending) >= REDUCE_INFLIGHT:  # the pool's reduce slots are all in flight
            self._finish_reduction(*self._pending.pop(0))
        buf = self.pool.acquire("grad_flat", u.padded)  # [padded]
        flat = u.flatten_grads(out=buf, views=self.pool.views(buf, u.layout.views))  # clears p.grad
        if self.release is not None and u.kind == "sharded":
            self.release(u)
        # [S]: the first micro-step's result is the shard (every unit of reduce_order is sent on every
        # micro-step, so each shard is overwritten before any add: no zero-fill, no add, no buffer);
        # a later one goes through a pool buffer and is added in _finish_reduction
        out = u.grad_shard if self._overwrite else self.pool.acquire("grad_shard", u.shard_numel)
        work = self._reduce_scatter(out, flat, u, async_op=True)
        u.extra["rs_input"] = flat  # back to the pool once the reduce-scatter is waited
        self._pending.append((work, u, out))

    def _finish_reduction(self, work: object, u: FlatUnit, out: torch.Tensor) -> None:
        """Wait for one reduce-scatter, add it into ``u``'s gradient shard (unless it was written
        there), return its buffers to the pool."""
        work.wait()
        if out is not u.grad_shard:
            u.grad_shard.add_(out)
            self.pool.give_back(out)
        if self.land is not None and self._last_micro:  # final: to the host now, overlapping backward
            self.land(self._unit_index[id(u)], u.grad_shard)
        self.pool.give_back(u.extra.pop("rs_input", None))

    def finish_backward(self) -> None:
        """After a micro-step's backward: send the rest of the fixed order (units some of whose
        parameters got no gradient this micro-step, on this rank, are sent with zeros there, so
        every rank sends every unit) and wait for every reduce-scatter in flight."""
        for u in self.reduce_order[self._next_reduce :]:
            self._reduce_unit(u)
        self._next_reduce = len(self.reduce_order)
        for pending in self._pending:
            self._finish_reduction(*pending)
        self._pending.clear()
        self._overwrite = False  # every shard holds this step's first gradient: later ones add to it

    # ------------------------------------------------------------------ after the last micro-step
    def final_grads(self) -> list[torch.Tensor]:
        """Per unit, this rank's reduced gradient (compute dtype): shard, or whole unit if replicated.
        The all-reduces of the units kept whole (stage 0, replicated units) are all issued before the
        first is waited for: each unit's gradient is its own tensor until the step, so having them
        in flight together costs no memory, and the backend sends one while the next is flattened.
        Stage 1's reduce-scatters go one at a time through the pool's one buffer."""
        grads: list[torch.Tensor | None] = [None] * len(self.units)
        reducing: list[tuple[int, torch.Tensor, Pending]] = []  # all-reduces in flight, in unit order
        try:
            for i, u in enumerate(self.units):
                if self.reduces_when_ready(u):
                    grads[i] = u.grad_shard
                    continue
                pooled = u.kind == "sharded_opt"  # stage 1: a communication buffer; stage 0: the gradient itself
                flat = u.flatten_grads(out=self.pool.acquire("grad_flat", u.padded) if pooled else None)  # [padded]
                if u.kind == "replicated":
                    grads[i] = flat
                    work = self.comm.all_reduce_mean(flat, kind=CommKind.GRAD_ALL_REDUCE, unit=u.name, async_op=True)
                    reducing.append((i, flat, work))
                    continue
                out = torch.empty(u.shard_numel, dtype=self.dtype, device=self.device)  # stage 1: one reduce-scatter
                self._reduce_scatter(out, flat, u, async_op=False)
                self.pool.give_back(flat)
                grads[i] = out
                if self.land is not None:
                    self.land(i, out)
        except BaseException:
            for _, _, work in reducing:  # nothing may still write into a gradient the caller drops
                work.wait()
            raise
        for i, flat, work in reducing:
            work.wait()
            if self.land is not None:
                self.land(i, flat)
        assert all(g is not None for g in grads)
        return cast(list[torch.Tensor], grads)

    def close(self) -> None:
        """Remove the gradient hooks and wait for the reduce-scatters still in flight. Local."""
        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks.clear()
        for pending in self._pending:
            pending[0].wait()
        self._pending.clear()
