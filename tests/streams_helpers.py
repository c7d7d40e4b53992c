"""The streams debug mode (``ZEROPP_DEBUG_STREAMS=1``) on a gloo world: representative runs,
compared with the same runs outside the mode, and the two early releases it must expose.

Called from inside a rank (``tests/distributed/test_comm_overlap.py`` runs it in its 2x2 world, launched
with :data:`DEBUG_ENV`, so it costs no launch of its own). :func:`debug_checks` returns, per
case, whether the result equals the run without the mode:

- ``fixed``: the code as it is; every case must be equal;
- ``hop1_early``: qgZ's continuation does not own hop 1's rows (released at issue, as when
  nothing kept them for the continuation's stream); every case runs hierarchical qgZ, so every
  one must differ;
- ``pool_early``: the engine hands a reduce-scatter's output back to its pool before waiting
  for it; the engine step must differ.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from tests.comm_helpers import rank_input
from zeropp.comm import CommStats, QuantSpec, Topology, chain, context, quantized_reduce_scatter

DEBUG_ENV = {context.DEBUG_ENV: "1"}
"""The environment of a world that runs in the debug mode."""


class FakeBucket:
    """The two methods of ``dist.GradBucket`` the DDP hook uses."""

    def __init__(self, buf: torch.Tensor, index: int) -> None:
        self._buf, self._index = buf, index

    def buffer(self) -> torch.Tensor:
        return self._buf

    def index(self) -> int:
        return self._index


@contextmanager
def hop1_released_at_issue() -> Iterator[None]:
    """The bug: a continuation does not own the buffers handed to it (released at issue)."""
    real = chain.submit

    def early(fn, device, buffers=None, **kwargs):
        if buffers is not None:
            buffers.release()
        return real(fn, device, **kwargs)

    chain.submit = early
    try:
        yield
    finally:
        chain.submit = real


@contextmanager
def shard_given_back_before_wait() -> Iterator[None]:
    """The bug: the engine hands a reduce-scatter's output back to the pool before waiting for it."""
    from zeropp.runtime.reduction import GradReducer

    real = GradReducer._finish_reduction

    def early(self, work, u, out):
        pooled = out is not u.grad_shard  # (a step's first micro-step writes the shard itself)
        if pooled:
            self.pool.give_back(out)
        work.wait()
        if pooled:
            u.grad_shard.add_(out)
        self.pool.give_back(u.extra.pop("rs_input", None))

    GradReducer._finish_reduction = early
    try:
        yield
    finally:
        GradReducer._finish_reduction = real


def _engine(rank: int, world: int) -> list[torch.Tensor]:
    """One stage-3 ZeRO++ step (qwZ, hpZ, qgZ chunked by a small bucket, pooled buffers; two
    micro-steps, so the second one's reduce-scatters land in pooled buffers)."""
    from tests.runtime_helpers import train_engine

    zpp = dict(
        stage=3,
        weights=QuantSpec(bits=8),
        grads=QuantSpec(bits=4),
        hpz=True,
        reduce_bucket_size=300,
        grad_accum_steps=2,
    )
    run = train_engine(rank, world, zpp, steps=1, nodes=2, lr=1e-2, consolidate=False)
    return [torch.tensor(run["losses"] + run["norms"], dtype=torch.float64)]


def scenarios(rank: int, world: int, only_engine: bool = False) -> dict[str, list[torch.Tensor]]:
    """The representative cases on a 2-node world: outstanding async qgZ, chunked qgZ (the
    engine's chunk loop), the DDP hook, one engine step."""
    from zeropp.comm.ddp import QuantizedAllReduceState, quantized_allreduce_hook
    from zeropp.runtime.collectives import EngineComm

    res: dict[str, list[torch.Tensor]] = {}
    if not only_engine:
        topo, spec = Topology(2, world // 2), QuantSpec(bits=4)
        sizes = [1, 7, 257]
        xs = [rank_input(60, rank, world * n, torch.float32) for n in sizes]
        outs = [torch.empty(n) for n in sizes]
        hs = [
            quantized_reduce_scatter(o, x, spec=spec, topology=topo, stats=CommStats(), async_op=True)
            for o, x in zip(outs, xs)
        ]
        for h in reversed(hs):
            h.wait()
        res["qgz_async"] = outs
        comm = EngineComm(topo, CommStats())
        full, shard = rank_input(61, rank, world * 50, torch.float32), torch.empty(50)
        comm.reduce_scatter(shard, full, spec=spec, bucket=world * 8, kind="rs", async_op=True).wait()  # 7 chunks
        res["qgz_chunked"] = [shard]
        state = QuantizedAllReduceState(grads=spec, topology=topo, stats=CommStats())
        bufs = [rank_input(62 + k, rank, n, torch.float32) for k, n in enumerate((5, 33))]
        futs = [quantized_allreduce_hook(state, FakeBucket(b, k)) for k, b in enumerate(bufs)]
        res["ddp_hook"] = [f.wait() for f in futs]
    res["engine"] = _engine(rank, world)
    return res


def _same(runs: dict[str, list[torch.Tensor]], ref: dict[str, list[torch.Tensor]]) -> dict[str, bool]:
    return {k: all(torch.equal(x, y) for x, y in zip(v, ref[k], strict=True)) for k, v in runs.items()}


def debug_checks(rank: int, world: int) -> dict:
    """In a rank of a world launched with :data:`DEBUG_ENV`: see the module docstring."""
    ctx = context.current()
    out = {"debug_on": ctx.debug_streams}  # the launcher's environment reached the rank
    ctx.debug_streams = False
    try:
        ref = scenarios(rank, world)  # the reference: the same runs outside the mode
    finally:
        ctx.debug_streams = True
    out["fixed"] = _same(scenarios(rank, world), ref)
    with hop1_released_at_issue():
        out["hop1_early"] = _same(scenarios(rank, world), ref)
    with shard_given_back_before_wait():
        out["pool_early"] = _same(scenarios(rank, world, only_engine=True), ref)
    return out
