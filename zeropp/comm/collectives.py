"""The public collectives: qwZ all-gather, qgZ reduce-scatter, all-reduce, all with byte accounting.

Signatures follow ``torch.distributed`` (``output, input, [op,] group``) plus keywords: one
``spec`` (a :class:`~zeropp.comm.spec.QuantSpec`, or None for the plain backend collective) says
how the payload is quantized, so a caller switches quantization with one argument and a new
scheme (``codecs.register_codec``) reaches every collective without editing them. The
accounting convention is in ``stats.py``; the stochastic-rounding seed rule in ``stochastic.py``.

Device rule: everything handed to the backend (packed rows, receive buffers, temporaries) is
allocated on the input's device, which under NCCL is the process group's device.

Lifetime rule (``lifetime.py``): those buffers belong to the call's handle (or continuation) and
are released when it finished, on the stream that finished it, never while the backend or the
post-processing may still use them.

Session rule (``session.py``): ``session=`` names the engine's or plug-in's
:class:`~.session.CommSession`, whose topology, stats, stochastic-rounding counter, side streams
and wait hooks the call uses; without it the call uses the default session (the process-wide
convenience for plain calls). ``topology=`` / ``stats=``, when given, take precedence over the
session's for that call.

Autograd rule: like ``torch.distributed``'s, these collectives are not differentiable and record
nothing for autograd; they read and write the tensors through ``detach()``-ed aliases, so a
tensor that requires grad (a parameter, a leaf) is reduced or gathered in place as any other,
also by a continuation or a ``wait()`` that runs with grad mode on.

Contract rule (``callcheck.py``): every rank of the group makes the same call: the same element
count, the same spec (scheme, bits, group size, intra bits, ...), the same op and, unquantized,
the same dtype, in the same order. The backend does not always notice a breach (quantized rows
are padded to whole groups, so different counts can give rows of one size) and the result is
then silently wrong; ``ZEROPP_DEBUG_COLLECTIVES=1`` (or ``CommSession(check_collectives=True)``)
checks every call and raises the same ValueError on every rank, before any data is sent, at the
cost of one small exchange per call.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from zeropp.kernels import DEFAULT_GRAD_GROUP_SIZE, DEFAULT_WEIGHT_GROUP_SIZE

from . import callcheck, qgz, ranges
from . import stochastic as sr
from .backend import (
    CommHandle,
    ReduceOpLike,
    backend_all_gather,
    backend_all_reduce,
    backend_all_to_all,
    backend_reduce_scatter,
    check_contiguous,
    check_float,
    check_gather_spec,
    check_member,
    check_op_dtype,
    check_plain_dtypes,
    check_reduce_spec,
    finish_or_handle,
    parse_op,
)
from .codecs import codec_for
from .feedback import ErrorFeedback
from .kinds import CommKind
from .lifetime import Buffers
from .session import CommSession
from .session import resolve as resolve_session
from .spec import QuantSpec
from .stats import CommStats, group_ranks, peer_bytes, record_sends
from .topology import Topology

ReduceOp = dist.ReduceOp


def quantized_all_gather(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
    *,
    spec: Optional[QuantSpec] = None,
    topology: Optional[Topology] = None,
    stats: Optional[CommStats] = None,
    kind: str = CommKind.ALL_GATHER,
    async_op: bool = False,
    name: Optional[str] = None,
    session: Optional[CommSession] = None,
    wire_out: Optional[torch.Tensor] = None,
) -> Optional[CommHandle]:
    """qwZ: gather every member's shard into ``output_tensor`` ([W * n], member order).

    Quantized (``spec`` given): each rank quantizes its shard with the codec of ``spec.scheme``
    at ``spec.bits`` (``spec.group_size`` elements per scale, default 512), the wire row is
    all-gathered, and the rows are dequantized into ``output_tensor``, whose dtype sets the
    output precision. The input is read (quantized) before the output is written, so the input
    may be a view into the output, as FSDP2 passes it. ``spec=None``: the backend all-gather.
    A spec with ``intra_bits`` or ``error_feedback`` is refused (one hop, nothing carried over).

    Every rank of the group passes the same ``n`` and the same ``spec`` (unquantized: the same
    dtype); otherwise the result can be silently wrong. ``ZEROPP_DEBUG_COLLECTIVES=1`` checks
    that (module docstring, ``callcheck.py``).

    Zero-copy with the ``int`` codec: the shard is quantized straight into the one send buffer
    (codes and scales of the row side by side, one message), and the received buffer is
    dequantized in place, through views, straight into ``output_tensor``. Quantized, the output
    may also be a row-strided ``[W, n]`` view (columns ``[a:b]`` of a ``[W, S]`` gathered
    buffer, as the engine's bucketed gathers pass), which is written in place.

    ``spec.rounding="stochastic"`` rounds stochastically (unbiased). Each such call takes the
    next index of its session's counter and quantizes with the kernel seed
    ``stochastic_seed(spec.seed, global rank, call index, 0)`` (``zeropp.comm.stochastic``):
    different noise on every rank and every call, reproducible for a given (seed, rank, call).

    ``name``: the call's profiler range (``ranges.py``; None: ``zeropp/<kind>``), with its
    ``/quantize`` and ``/dequantize`` parts.

    ``wire_out`` (quantized only): a contiguous ``uint8 [W * B]`` tensor on the input's device
    (``B = codec.wire_bytes(n, ...)``) that receives the gathered wire rows instead of a
    temporary, and keeps them after the call: every member's encoding, exactly as dequantized
    into ``output_tensor``. hpZ keeps its share of them as a quantized secondary copy, so a later
    gather of those rows inside the node reproduces the output bit for bit at a quarter of the
    bytes (INT8).
    """
    name = _range(name, kind)
    output_tensor, input_tensor = output_tensor.detach(), input_tensor.detach()  # autograd rule (module docstring)
    with ranges.span(name):
        return _all_gather(
            output_tensor, input_tensor, group, spec, topology, stats, kind, async_op, name, session, wire_out
        )


def _all_gather(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    spec: Optional[QuantSpec],
    topology: Optional[Topology],
    stats: Optional[CommStats],
    kind: str,
    async_op: bool,
    name: Optional[str],
    session: Optional[CommSession],
    wire_out: Optional[torch.Tensor] = None,
) -> Optional[CommHandle]:
    """:func:`quantized_all_gather` inside its range."""
    sess = resolve_session(session)
    ranks = group_ranks(group)
    check_member(ranks, "all-gather")
    W, n = len(ranks), input_tensor.numel()
    # the argument checks; then, in the collectives debug mode, all ranks' calls compared (callcheck.py)
    with callcheck.agreed(sess.check_collectives, group, "quantized_all_gather", ranks, n, spec=spec) as fp:
        check_gather_spec(spec)
        topo = sess.resolve_topology(topology)
        if output_tensor.numel() != W * n:
            raise ValueError(
                f"all-gather output has {output_tensor.numel()} elements but the group of {W} ranks "
                f"gathers {W} x {n} = {W * n}; allocate output with {W * n} elements"
            )
        _check_rows(output_tensor, W, n, spec, "all-gather output", written=True)
        if output_tensor.device != input_tensor.device:
            raise ValueError(f"output on {output_tensor.device} but input on {input_tensor.device}; use one device")
        if spec is not None:
            check_float(input_tensor, "all-gather input")
            check_float(output_tensor, "all-gather output")
        elif wire_out is not None:
            raise ValueError("all-gather wire_out holds quantized wire rows; it needs a spec (got spec=None)")
        else:
            check_plain_dtypes(output_tensor, input_tensor, "all-gather")
            fp["dtype"] = callcheck.dtype_name(input_tensor.dtype)  # plain: the dtype is the wire's
        if spec is not None and n:
            codec = codec_for(spec)
            bits = spec.bits
            gs = DEFAULT_WEIGHT_GROUP_SIZE if spec.group_size is None else spec.group_size
            B = codec.wire_bytes(n, bits, gs)
            recv = _wire_out(wire_out, W * B, input_tensor.device)  # [W * B] on the input's device
            if not codec.in_place and not output_tensor.is_contiguous():
                raise ValueError(
                    f"codec {spec.scheme!r} writes only contiguous outputs; pass a contiguous all-gather output"
                )
    stats = stats if stats is not None else sess.stats
    stats.count_call(kind)
    kseed = None
    if spec is not None and spec.stochastic:
        kseed = sr.stochastic_seed(spec.seed, dist.get_rank(), sess.stochastic.take())
    if n == 0:
        return finish_or_handle([], None, async_op, session=sess, kind=kind)

    if spec is None:
        inp = input_tensor.reshape(-1)
        record_sends(stats, kind, topo, ranks, peer_bytes("all_gather", inp.numel() * inp.element_size(), len(ranks)))
        if output_tensor.dtype == inp.dtype:
            work = backend_all_gather(output_tensor.view(-1), inp, group, async_op)
            return finish_or_handle([work], None, async_op, session=sess, kind=kind)
        tmp = torch.empty(W * n, dtype=inp.dtype, device=inp.device)
        src = inp.contiguous()
        work = backend_all_gather(tmp, src, group, async_op)
        return finish_or_handle(
            [work],
            lambda: output_tensor.view(-1).copy_(tmp),
            async_op,
            Buffers(tmp, src, protect=(input_tensor, output_tensor)),
            session=sess,
            kind=kind,
        )

    with ranges.span(name, "quantize"):
        send = codec.encode(input_tensor.reshape(-1), bits, gs, rows=1, seed=kseed).view(-1)  # [B]; reads input first
    if send.numel() != B or send.dtype != torch.uint8:
        raise RuntimeError(
            f"codec {spec.scheme!r} packed a {send.dtype} row of {send.numel()} bytes; "
            f"its wire_bytes says {B} uint8 bytes"
        )
    record_sends(stats, kind, topo, ranks, peer_bytes("all_gather", B, len(ranks)))
    work = backend_all_gather(recv, send, group, async_op)

    def finish() -> None:
        # [W, B] received rows, read through views, dequantized straight into output ([W, n])
        with ranges.span(name, "dequantize"):
            codec.dequantize(codec.unpack(recv.view(W, B), n, bits, gs), out=output_tensor)

    ours = (send, recv) if wire_out is None else (send,)  # the caller's wire_out is borrowed, never poisoned
    held = Buffers(*ours, protect=(input_tensor, output_tensor), borrowed=(wire_out,))
    return finish_or_handle([work], finish, async_op, held, session=sess, kind=kind)


def _wire_out(wire_out: Optional[torch.Tensor], nbytes: int, device: torch.device) -> torch.Tensor:
    """The all-gather's receive buffer: the caller's ``wire_out`` (checked), else a new one."""
    if wire_out is None:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    if wire_out.dtype != torch.uint8 or wire_out.numel() != nbytes or not wire_out.is_contiguous():
        raise ValueError(
            f"all-gather wire_out must be a contiguous uint8 tensor of {nbytes} bytes (the gathered wire rows), "
            f"got {wire_out.dtype} {tuple(wire_out.shape)}{'' if wire_out.is_contiguous() else ' non-contiguous'}"
        )
    if wire_out.device != device:
        raise ValueError(f"all-gather wire_out on {wire_out.device} but input on {device}; use one device")
    return wire_out.view(-1)


def quantized_reduce_scatter(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    op: ReduceOpLike = ReduceOp.AVG,
    group: Optional[dist.ProcessGroup] = None,
    *,
    spec: Optional[QuantSpec] = None,
    error_feedback: Optional[ErrorFeedback] = None,
    feedback_key: str = "default",
    topology: Optional[Topology] = None,
    stats: Optional[CommStats] = None,
    kind: str = CommKind.REDUCE_SCATTER,
    async_op: bool = False,
    name: Optional[str] = None,
    session: Optional[CommSession] = None,
) -> Optional[CommHandle]:
    """qgZ: reduce ``input_tensor`` ([W * n], W chunks) over the group; member ``j`` gets chunk ``j``
    (summed, or averaged over all W members for AVG; PREMUL_SUM(f) sums ``f * x``) in
    ``output_tensor`` ([n]), as ``reduce_scatter_tensor`` would.

    Quantized (``spec`` given): ``spec.bits`` for the cross-node hop, ``spec.intra_bits``
    (default = bits) for the intra-node hop, ``spec.group_size`` elements per scale (default
    128), all through the codec of ``spec.scheme``. Over the whole world of a multi-node
    ``topology`` the hierarchical two-hop algorithm of ``qgz.py`` runs; otherwise (one node, one
    rank per node, or a sub-group) a single quantized all-to-all. ``spec=None``: the backend
    reduce-scatter (PREMUL_SUM emulated on gloo).

    Every rank of the group passes the same ``n``, ``op`` and ``spec`` (unquantized: the same
    dtype) under the same topology; otherwise the result can be silently wrong.
    ``ZEROPP_DEBUG_COLLECTIVES=1`` checks that (module docstring, ``callcheck.py``).

    Error feedback: ``spec.error_feedback=True`` *and* a caller-owned :class:`ErrorFeedback` in
    ``error_feedback``, with one ``feedback_key`` per gradient bucket (see ``feedback.py``); one
    without the other is a ValueError.

    ``spec.rounding="stochastic"``: the call takes the next index of its session's counter
    (shared with its :func:`quantized_all_gather` calls); this rank's first quantization uses the kernel seed
    ``stochastic_seed(spec.seed, global rank, call index, 0)``, the hierarchical re-quantization
    ``stochastic_seed(..., 1)`` (``zeropp.comm.stochastic``).

    Zero-copy with the ``int`` codec: each destination's chunk is quantized straight into its
    slot of the all-to-all send buffer (in qgZ's swizzled order, read in place), received
    buffers are reduced through views, and the sum is written into ``output_tensor``.
    Quantized, the input may also be a row-strided ``[W, n]`` view (columns of a ``[W, S]``
    buffer), read in place.

    ``name``: the call's profiler range (``ranges.py``; None: ``zeropp/<kind>``); a quantized call
    names its hops ``<name>/intra`` and ``<name>/cross`` instead, each with its parts.
    """
    name = _range(name, kind)
    output_tensor, input_tensor = output_tensor.detach(), input_tensor.detach()  # autograd rule (module docstring)
    sess = resolve_session(session)
    ranks = group_ranks(group)
    check_member(ranks, "reduce-scatter")
    W, n = len(ranks), output_tensor.numel()
    # the argument checks; then, in the collectives debug mode, all ranks' calls compared (callcheck.py)
    with callcheck.agreed(sess.check_collectives, group, "quantized_reduce_scatter", ranks, n, spec=spec) as fp:
        check_reduce_spec(spec, error_feedback)
        topo = sess.resolve_topology(topology)
        if input_tensor.numel() != W * n:
            raise ValueError(
                f"reduce-scatter input has {input_tensor.numel()} elements but output has {n} and the "
                f"group has {W} ranks; the input must hold {W} x {n} = {W * n} elements (pad it)"
            )
        check_contiguous(output_tensor, "reduce-scatter output")
        _check_rows(input_tensor, W, n, spec, "reduce-scatter input")
        if output_tensor.device != input_tensor.device:
            raise ValueError(f"output on {output_tensor.device} but input on {input_tensor.device}; use one device")
        op_name, factor = parse_op(op)
        fp["op"] = callcheck.op_name(op_name, factor)
        if spec is None:
            check_plain_dtypes(output_tensor, input_tensor, "reduce-scatter")
            check_op_dtype(op_name, input_tensor, "reduce-scatter")
            fp["dtype"] = callcheck.dtype_name(input_tensor.dtype)  # plain: the dtype is the wire's
        else:
            fp["topology"] = callcheck.topology_name(topo)  # picks one hop or qgZ's two
            if op_name not in ("sum", "avg", "premul_sum"):
                raise ValueError(
                    f"quantized reduce-scatter supports SUM, AVG and PREMUL_SUM, not {op_name.upper()}; use spec=None"
                )
            check_float(input_tensor, "reduce-scatter input")
            check_float(output_tensor, "reduce-scatter output")
            codec = codec_for(spec)
    stats = stats if stats is not None else sess.stats
    if spec is None:
        stats.count_call(kind)
        if n == 0:
            return finish_or_handle([], None, async_op, session=sess, kind=kind)
        with ranges.span(name):
            return _plain_reduce_scatter(
                output_tensor, input_tensor, op, op_name, factor, group, ranks, topo, stats, kind, async_op, sess
            )
    stats.count_call(kind)
    seeds = None
    if spec.stochastic:
        me, call = dist.get_rank(), sess.stochastic.take()
        seeds = (sr.stochastic_seed(spec.seed, me, call, 0), sr.stochastic_seed(spec.seed, me, call, 1))
    if n == 0:
        return finish_or_handle([], None, async_op, session=sess, kind=kind)
    post_scale = factor / W if op_name == "avg" else factor
    intra_bits, bits = spec.hop_bits
    gs = DEFAULT_GRAD_GROUP_SIZE if spec.group_size is None else spec.group_size
    plan = qgz.QgzPlan(topo, ranks, n, bits, intra_bits, gs, codec)
    return qgz.run(
        plan,
        output_tensor,
        input_tensor,
        post_scale,
        group,
        error_feedback,
        feedback_key,
        stats,
        kind,
        async_op,
        seeds,
        name,
        session=sess,
    )


def _plain_reduce_scatter(
    out: torch.Tensor,
    inp: torch.Tensor,
    op: ReduceOpLike,
    op_name: str,
    factor: float,
    group: Optional[dist.ProcessGroup],
    ranks: list[int],
    topo: Topology,
    stats: CommStats,
    kind: str,
    async_op: bool,
    session: CommSession,
) -> Optional[CommHandle]:
    """Backend reduce-scatter; converts dtypes through a temporary and emulates PREMUL_SUM on gloo.

    A sum on gloo is an all-to-all plus a local sum (:func:`_gloo_reduce_scatter_sum`): gloo's own
    reduce-scatter clones the input and all-reduces the clone, sending twice the bytes. So is a
    half-precision average, whose sum is accumulated in fp32 and divided before its one rounding:
    gloo's AVG sums in the half dtype and divides after, so a mean that fp16 holds (4 ranks of
    40000) came back inf, where DDP's own all-reduce (which divides first) gives it."""
    W = len(ranks)
    record_sends(stats, kind, topo, ranks, peer_bytes("reduce_scatter", inp.numel() * inp.element_size(), W))
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
        work, summed = _gloo_reduce_scatter_sum(dst, src, W, group, async_op, bufs, mean=half_avg)

        def sum_then_out() -> None:
            summed()
            if not direct:
                to_out()

        finish = sum_then_out
    else:
        work = backend_reduce_scatter(dst, src, op, group, async_op)
    return finish_or_handle([work], finish, async_op, bufs, session=session, kind=kind)


def _gloo_reduce_scatter_sum(
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
    tensor = tensor.detach()  # autograd rule (module docstring)
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
        with ranges.span(_range(name, kind)):
            work = backend_all_reduce(tensor, op, group, async_op)
        return finish_or_handle([work], None, async_op, session=sess, kind=kind)
    # gloo reduces a tensor's storage from its offset, not its view: a strided view (a slice of a
    # bigger buffer) would have elements outside it overwritten and elements of it left unreduced.
    # So a non-contiguous tensor is reduced as a contiguous copy, written back when it finished.
    dense = tensor.contiguous()
    with ranges.span(_range(name, kind)):
        work = backend_all_reduce(dense, op, group, async_op)
    return finish_or_handle(
        [work], lambda: tensor.copy_(dense), async_op, Buffers(dense, protect=(tensor,)), session=sess, kind=kind
    )


def quantized_all_reduce(
    tensor: torch.Tensor,
    op: ReduceOpLike = ReduceOp.AVG,
    group: Optional[dist.ProcessGroup] = None,
    *,
    spec: Optional[QuantSpec] = None,
    gather_spec: Optional[QuantSpec] = None,
    error_feedback: Optional[ErrorFeedback] = None,
    feedback_key: str = "default",
    topology: Optional[Topology] = None,
    stats: Optional[CommStats] = None,
    kind: str = CommKind.ALL_REDUCE,
    session: Optional[CommSession] = None,
) -> torch.Tensor:
    """In-place all-reduce of any-size ``tensor`` as a reduce-scatter of the zero-padded flat
    tensor (quantized by ``spec``; error feedback as in :func:`quantized_reduce_scatter`)
    followed by an all-gather of the reduced chunks (quantized by ``gather_spec``, default
    plain). Synchronous; returns ``tensor``. Both halves are recorded under ``kind``; each
    stochastic half takes its own call index of the seed rule. Every rank passes the same element
    count, op and specs (``ZEROPP_DEBUG_COLLECTIVES=1`` checks it, ``callcheck.py``)."""
    given = tensor
    tensor = tensor.detach()  # autograd rule (module docstring)
    ranks = group_ranks(group)
    check_member(ranks, "all-reduce")
    check = resolve_session(session).check_collectives  # debug mode: this call's, then each half's (callcheck.py)
    numel = tensor.numel()
    with callcheck.agreed(check, group, "quantized_all_reduce", ranks, numel, spec=spec, gather_spec=gather_spec) as fp:
        check_reduce_spec(spec, error_feedback)
        check_gather_spec(gather_spec, "gather_spec")
        if check:
            fp["op"] = callcheck.op_name(*parse_op(op))
            if spec is None or gather_spec is None:  # a plain half: the dtype is its wire's
                fp["dtype"] = callcheck.dtype_name(tensor.dtype)
    W = len(ranks)
    n = -(-numel // W)  # ceil: chunk per rank
    direct = tensor.is_contiguous() and numel == W * n  # no padding: reduce and gather in place
    if direct:
        flat = tensor.view(-1)
    else:
        flat = torch.zeros(W * n, dtype=tensor.dtype, device=tensor.device)  # [W * n], padded
        flat[:numel] = tensor.reshape(-1)
    chunk = torch.empty(n, dtype=tensor.dtype, device=tensor.device)  # [n], my reduced chunk
    quantized_reduce_scatter(
        chunk,
        flat,
        op,
        group,
        spec=spec,
        error_feedback=error_feedback,
        feedback_key=feedback_key,
        topology=topology,
        stats=stats,
        kind=kind,
        session=session,
    )
    quantized_all_gather(
        flat, chunk, group, spec=gather_spec, topology=topology, stats=stats, kind=kind, session=session
    )
    if not direct:
        tensor.view(-1).copy_(flat[:numel]) if tensor.is_contiguous() else tensor.copy_(flat[:numel].view_as(tensor))
    Buffers(chunk, flat, protect=(tensor,)).release()  # both calls were synchronous: done with them here
    return given


def _check_rows(t: torch.Tensor, W: int, n: int, spec: Optional[QuantSpec], what: str, written: bool = False) -> None:
    """A collective's ``[W * n]`` side must be contiguous; a quantized one may also be a ``[W, n]``
    view whose rows are each contiguous and a fixed stride apart (the kernels index it in place).
    A ``written`` side's rows must not overlap (a row stride of at least ``n``; an ``expand``-ed
    or ``as_strided`` view would have each member's row overwrite the others'): refused here,
    before any message, rather than by the kernel after the gather."""
    if t.is_contiguous():
        return
    rows_ok = t.dim() == 2 and tuple(t.shape) == (W, n) and (n <= 1 or t.stride(1) == 1)
    if spec is not None and rows_ok and (not written or W <= 1 or t.stride(0) >= n):
        return
    hint = f" or, quantized, a [{W}, {n}] view with contiguous rows" if spec is not None else ""
    raise ValueError(
        f"{what} must be contiguous{hint} (got shape {tuple(t.shape)}, strides {tuple(t.stride())}); "
        "pass t.contiguous()"
    )


def _range(name: Optional[str], kind: str) -> Optional[str]:
    """A call's range name: ``name``, else ``zeropp/<kind>`` while a profiler records (else None:
    no name is built)."""
    return name if name is not None or not ranges.enabled() else ranges.call_name(kind)
