"""The plain (unquantized) collectives: backend calls with byte accounting, dtype conversion and
gloo's gaps filled.

``all_reduce`` is public; the plain all-gather and reduce-scatter are the ``spec=None`` paths of
:func:`~.gather.quantized_all_gather` and :func:`~.reduce_scatter.quantized_reduce_scatter`, which
check the arguments before calling them. ``rank_order_sum`` is the local sum of gloo's all-to-all
reduce-scatter, shared with the shared-memory transport (``shm.py``) so both give the same bits.
The rules every collective keeps (devices, buffer lifetimes, sessions, autograd, the call contract)
are in ``collectives.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.distributed as dist

from . import callcheck, ranges
from .backend import (
    CommHandle,
    ReduceOpLike,
    backend_all_gather,
    backend_all_reduce,
    backend_all_to_all,
    backend_reduce_scatter,
    check_member,
    check_op_dtype,
    finish_or_handle,
    parse_op,
)
from .kinds import CommKind
from .lifetime import Buffers
from .session import CommSession
from .session import resolve as resolve_session
from .stats import CommStats, group_ranks, peer_bytes, record_sends
from .topology import Topology

ReduceOp = dist.ReduceOp


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlainCall:
    """Where a plain call whose arguments were checked goes, and where it is recorded."""

    group: Optional[dist.ProcessGroup]
    ranks: list[int]
    """The group's global ranks, in group order."""
    topo: Topology
    stats: CommStats
    kind: str
    async_op: bool
    session: CommSession


def plain_all_gather(output_tensor: torch.Tensor, input_tensor: torch.Tensor, call: PlainCall) -> Optional[CommHandle]:
    """Backend all-gather of ``input_tensor`` ([n]) into ``output_tensor`` ([W * n]); an output of
    another float dtype is gathered into a temporary and converted."""
    W, group, async_op = len(call.ranks), call.group, call.async_op
    inp = input_tensor.reshape(-1)  # [n]
    n = inp.numel()
    record_sends(call.stats, call.kind, call.topo, call.ranks, peer_bytes("all_gather", n * inp.element_size(), W))
    if output_tensor.dtype == inp.dtype:
        work = backend_all_gather(output_tensor.view(-1), inp, group, async_op)
        return finish_or_handle([work], None, async_op, session=call.session, kind=call.kind)
    tmp = torch.empty(W * n, dtype=inp.dtype, device=inp.device)  # [W * n] in the wire's dtype
    src = inp.contiguous()
    work = backend_all_gather(tmp, src, group, async_op)
    return finish_or_handle(
        [work],
        lambda: output_tensor.view(-1).copy_(tmp),
        async_op,
        Buffers(tmp, src, protect=(input_tensor, output_tensor)),
        session=call.session,
        kind=call.kind,
    )


def plain_reduce_scatter(
    out: torch.Tensor, inp: torch.Tensor, op: ReduceOpLike, op_name: str, factor: float, call: PlainCall
) -> Optional[CommHandle]:
    """Backend reduce-scatter; converts dtypes through a temporary and emulates PREMUL_SUM on gloo.

    A sum on gloo is an all-to-all plus a local sum (:func:`gloo_reduce_scatter_sum`): gloo's own
    reduce-scatter clones the input and all-reduces the clone, sending twice the bytes. So is a
    half-precision average, whose sum is accumulated in fp32 and divided before its one rounding:
    gloo's AVG sums in the half dtype and divides after, so a mean that fp16 holds (4 ranks of
    40000) came back inf, where DDP's own all-reduce (which divides first) gives it."""
    W, group, async_op = len(call.ranks), call.group, call.async_op
    record_sends(
        call.stats, call.kind, call.topo, call.ranks, peer_bytes("reduce_scatter", inp.numel() * inp.element_size(), W)
    )
    src = inp.view(-1)
    gloo = dist.get_backend(group) == "gloo"
    if op_name == "premul_sum" and gloo:  # gloo has no PREMUL_SUM
        src, op, op_name = src * factor, ReduceOp.SUM, "sum"
    direct = out.dtype == src.dtype
    dst = out.view(-1) if direct else torch.empty(out.numel(), dtype=src.dtype, device=src.device)
    bufs = Buffers(src, dst, protect=(inp, out))

    def to_out() -> None:
        out.view(-1).copy_(dst)

    finish: Optional[Callable[[], object]] = None if direct else to_out
    half_avg = op_name == "avg" and src.dtype in (torch.float16, torch.bfloat16)
    if gloo and (op_name == "sum" or half_avg) and W > 1:
        work, summed = gloo_reduce_scatter_sum(dst, src, W, group, async_op, bufs, mean=half_avg)

        def sum_then_out() -> None:
            summed()
            if not direct:
                to_out()

        finish = sum_then_out
    else:
        work = backend_reduce_scatter(dst, src, op, group, async_op)
    return finish_or_handle([work], finish, async_op, bufs, session=call.session, kind=call.kind)


def sum_reduce_scatter_call(group: Optional[dist.ProcessGroup]) -> str:
    """The ``torch.distributed`` collective (its kind: ``all_to_all`` or ``reduce_scatter``) a sum
    reduce-scatter over ``group`` of two or more ranks issues here: on gloo an all-to-all
    (:func:`gloo_reduce_scatter_sum`), else the backend's reduce-scatter. A route that carries the
    reduction itself reports it so, to be counted as the call it replaces."""
    return "all_to_all" if dist.get_backend(group) == "gloo" else "reduce_scatter"


def gloo_reduce_scatter_sum(
    dst: torch.Tensor,
    src: torch.Tensor,
    W: int,
    group: Optional[dist.ProcessGroup],
    async_op: bool,
    bufs: Buffers,
    mean: bool = False,
) -> tuple[Optional[dist.Work], Callable[[], object]]:
    """A SUM reduce-scatter on gloo as an all-to-all (chunk ``j`` of ``src`` to group rank ``j``)
    whose ``W`` received chunks are summed locally, in group-rank order, into ``dst``; returns the
    work and that sum (run after the wait).

    Written here rather than calling ``reduce_scatter_single``: gloo implements that as a clone of
    the whole input on the calling thread plus an all-reduce of the clone (each rank sends
    ``2 (W - 1) / W`` of the input and reduces ``W - 1`` of its chunks), whereas the all-to-all
    sends ``(W - 1) / W`` of it once, and the receive buffer takes the clone's place (the same
    memory, for the same time). The sum's order differs from gloo's ring, so the result may differ
    from the backend's in the last bits (each is a correctly rounded sum of ``W`` terms in some
    order); a half-precision sum is accumulated in fp32 and rounded once. ``mean`` (half precision
    only): the fp32 sum divided by ``W`` before that rounding, so the mean never overflows where
    the sum would."""
    recv = torch.empty_like(src)  # [W * n]: row j is group rank j's chunk for this rank
    bufs.add(recv)
    work = backend_all_to_all(recv, src, group, async_op)
    if mean:
        return work, lambda: dst.copy_(torch.sum(recv.view(W, -1), 0, dtype=torch.float32).div_(W))
    return work, lambda: rank_order_sum(recv.view(W, -1), dst)


def rank_order_sum(rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = rows[0] + rows[1] + ... + rows[W - 1]`` (``rows``: ``[W, n]``, ``out``: ``[n]``), added
    in that order. fp32 / fp64: one element-wise addition at a time, rounded after each, exactly
    that order on every CPU (torch's ``sum`` over dim 0 takes another order from 5 rows on, and
    its outer-sum kernel is about 3x slower than the additions on cache-resident rows of this
    size). Half precision: accumulated in fp32 in the same order and rounded once (torch's ``sum``
    also accumulates in fp32, but in an order that depends on how the columns are cut, so two
    chunkings of one reduction could differ in the last bit)."""
    W = rows.shape[0]
    if W < 2:
        return out.copy_(rows.reshape(out.shape)) if W == 1 else out.zero_()
    if rows.dtype in (torch.float32, torch.float64):
        torch.add(rows[0], rows[1], out=out)
        for j in range(2, W):
            out.add_(rows[j])
        return out
    acc = torch.add(rows[0].float(), rows[1])  # [n] fp32
    for j in range(2, W):
        acc.add_(rows[j])
    return out.copy_(acc)


def all_reduce(
    tensor: torch.Tensor,
    op: ReduceOpLike = ReduceOp.SUM,
    group: Optional[dist.ProcessGroup] = None,
    *,
    topology: Optional[Topology] = None,
    stats: Optional[CommStats] = None,
    kind: str = CommKind.ALL_REDUCE,
    async_op: bool = False,
    name: Optional[str] = None,
    session: Optional[CommSession] = None,
) -> Optional[CommHandle]:
    """Plain backend all-reduce (ZeRO stages 0-2), accounted as reduce-scatter + all-gather:
    ``2 * nbytes / W`` to each other member (see ``stats.py``). ``name``: its profiler range
    (``ranges.py``; None: ``zeropp/<kind>``). Every rank passes the same element count, dtype and
    op (``ZEROPP_DEBUG_COLLECTIVES=1`` checks it, ``callcheck.py``). A non-contiguous ``tensor``
    (a strided view into a bigger buffer) is reduced as a contiguous copy that is written back
    when the call finishes: only the view's elements change."""
    tensor = tensor.detach()  # autograd rule (collectives.py)
    sess = resolve_session(session)
    ranks = group_ranks(group)
    check_member(ranks, "all-reduce")
    check = sess.check_collectives
    with callcheck.agreed(check, group, "all_reduce", ranks, tensor.numel()) as fp:  # callcheck.py
        topo = sess.resolve_topology(topology)
        op_name, factor = parse_op(op)
        check_op_dtype(op_name, tensor, "all-reduce")
        if check:
            fp["op"] = callcheck.op_name(op_name, factor)
            fp["dtype"] = callcheck.dtype_name(tensor.dtype)
    stats = stats if stats is not None else sess.stats
    stats.count_call(kind)
    W = len(ranks)
    record_sends(stats, kind, topo, ranks, peer_bytes("all_reduce", tensor.numel() * tensor.element_size(), W))
    if tensor.is_contiguous():
        with ranges.span(ranges.call_range(name, kind)):
            work = backend_all_reduce(tensor, op, group, async_op)
        return finish_or_handle([work], None, async_op, session=sess, kind=kind)
    # gloo reduces a tensor's storage from its offset, not its view: a strided view (a slice of a
    # bigger buffer) would have elements outside it overwritten and elements of it left unreduced.
    # So a non-contiguous tensor is reduced as a contiguous copy, written back when it finished.
    dense = tensor.contiguous()
    with ranges.span(ranges.call_range(name, kind)):
        work = backend_all_reduce(dense, op, group, async_op)
    return finish_or_handle(
        [work], lambda: tensor.copy_(dense), async_op, Buffers(dense, protect=(tensor,)), session=sess, kind=kind
    )
