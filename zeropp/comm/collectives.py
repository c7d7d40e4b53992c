"""The public collectives: qwZ all-gather, qgZ reduce-scatter, all-reduce, all with byte accounting.

Signatures follow ``torch.distributed`` (``output, input, [op,] group, async_op``); ``bits=None``
(or 16/32) selects the plain backend collective, so a caller switches quantization with one
argument. The accounting convention is in ``stats.py``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..kernels import DEFAULT_GRAD_GROUP_SIZE, DEFAULT_WEIGHT_GROUP_SIZE, dequantize, quantize
from . import qgz, stochastic as sr
from .backend import (
    CommHandle,
    ReduceOpLike,
    backend_all_gather,
    backend_reduce_scatter,
    check_bits_arg,
    check_contiguous,
    check_float,
    check_group_size_arg,
    check_member,
    finish_or_handle,
    is_plain,
    pack,
    parse_op,
    resolve_intra_bits,
    unpack,
    wire_row_bytes,
)
from .stats import CommStats, get_comm_stats, group_ranks, peer_bytes, record_sends
from .topology import Topology, resolve_topology

ReduceOp = dist.ReduceOp


def quantized_all_gather(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
    *,
    bits: Optional[int] = 8,
    group_size: Optional[int] = None,
    topology: Optional[Topology] = None,
    stats: Optional[CommStats] = None,
    kind: str = "all_gather",
    async_op: bool = False,
    stochastic: bool = False,
    seed: Optional[int] = None,
) -> Optional[CommHandle]:
    """qwZ: gather every member's shard into ``output_tensor`` ([W * n], member order).

    Quantized (bits 4/8): each rank block-quantizes its shard (``group_size`` elements per fp32
    scale, default 512), codes and scales are packed into one byte message and all-gathered,
    and the result is dequantized into ``output_tensor``, whose dtype sets the output precision.
    The input is read (quantized) before the output is written, so the input may be a view into
    the output, as FSDP2 passes it. Plain (bits None/16/32): the backend all-gather.

    ``stochastic=True`` rounds stochastically (unbiased: the expected dequantized shard is the
    shard). Each such call takes the next index of a per-process counter and quantizes with
    the kernel seed ``stochastic_seed(seed, global rank, call index, 0)`` (``zeropp.comm.stochastic``;
    ``seed`` None = 0, else an int in [0, 2**63)): different noise on every rank and every call,
    reproducible for a given (seed, rank, call index). Ignored (no index taken) when plain.
    """
    check_bits_arg(bits)
    base_seed = sr.check_base_seed(seed)
    gs = DEFAULT_WEIGHT_GROUP_SIZE if group_size is None else group_size
    check_group_size_arg(gs, [bits])
    topo = resolve_topology(topology)
    ranks = group_ranks(group)
    check_member(ranks, "all-gather")
    W, n = len(ranks), input_tensor.numel()
    if output_tensor.numel() != W * n:
        raise ValueError(
            f"all-gather output has {output_tensor.numel()} elements but the group of {W} ranks "
            f"gathers {W} x {n} = {W * n}; allocate output with {W * n} elements"
        )
    check_contiguous(output_tensor, "all-gather output")
    if output_tensor.device != input_tensor.device:
        raise ValueError(f"output on {output_tensor.device} but input on {input_tensor.device}; use one device")
    if not is_plain(bits):
        check_float(input_tensor, "all-gather input")
        check_float(output_tensor, "all-gather output")
    stats = stats if stats is not None else _default_stats()
    stats.count_call(kind)
    kseed = sr.stochastic_seed(base_seed, dist.get_rank(), sr.next_call()) if stochastic and not is_plain(bits) else 0
    if n == 0:
        return finish_or_handle([], None, async_op)

    if is_plain(bits):
        inp = input_tensor.reshape(-1)
        record_sends(stats, kind, topo, ranks, peer_bytes("all_gather", inp.numel() * inp.element_size(), len(ranks)))
        if output_tensor.dtype == inp.dtype:
            work = backend_all_gather(output_tensor.view(-1), inp, group, async_op)
            return finish_or_handle([work], None, async_op)
        tmp = torch.empty(W * n, dtype=inp.dtype, device=inp.device)
        work = backend_all_gather(tmp, inp.contiguous(), group, async_op)
        return finish_or_handle([work], lambda: output_tensor.view(-1).copy_(tmp), async_op)

    q = quantize(input_tensor.reshape(-1), bits, gs, rows=1, stochastic=bool(stochastic), seed=kseed)  # reads input first
    send = pack(q).view(-1)  # [B] = codes + scales of my shard
    B = wire_row_bytes(n, bits, gs)
    recv = torch.empty(W * B, dtype=torch.uint8, device=send.device)
    record_sends(stats, kind, topo, ranks, peer_bytes("all_gather", B, len(ranks)))
    work = backend_all_gather(recv, send, group, async_op)

    def finish() -> None:
        dequantize(unpack(recv.view(W, B), n, bits, gs), out=output_tensor)  # [W, n] into output

    return finish_or_handle([work], finish, async_op)


def quantized_reduce_scatter(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    op: ReduceOpLike = ReduceOp.AVG,
    group: Optional[dist.ProcessGroup] = None,
    *,
    bits: Optional[int] = 4,
    intra_bits: Optional[int] = None,
    group_size: Optional[int] = None,
    topology: Optional[Topology] = None,
    error_feedback: Optional[qgz.ErrorFeedback] = None,
    feedback_key: str = "default",
    stats: Optional[CommStats] = None,
    kind: str = "reduce_scatter",
    async_op: bool = False,
    stochastic: bool = False,
    seed: Optional[int] = None,
) -> Optional[CommHandle]:
    """qgZ: reduce ``input_tensor`` ([W * n], W chunks) over the group; member ``j`` gets chunk ``j``
    (summed, or averaged over all W members for AVG; PREMUL_SUM(f) sums ``f * x``) in
    ``output_tensor`` ([n]), as ``reduce_scatter_tensor`` would.

    Quantized: ``bits`` (default 4) for the cross-node hop, ``intra_bits`` (default = ``bits``)
    for the intra-node hop; ``group_size`` elements per scale (default 128). Over the whole world
    of a multi-node ``topology`` the hierarchical two-hop algorithm of ``qgz.py`` runs; otherwise
    (one node, one rank per node, or a sub-group) a single quantized all-to-all. Error feedback:
    pass an :class:`ErrorFeedback` and a ``feedback_key`` per bucket (see ``qgz.py``).
    Plain (bits None/16/32): the backend reduce-scatter (PREMUL_SUM emulated on gloo); error
    feedback does not apply there (nothing is rounded away).

    ``stochastic=True`` rounds every quantization stochastically (unbiased). The call takes the
    next index of the per-process counter shared with :func:`quantized_all_gather`; this rank's
    first quantization uses the kernel seed ``stochastic_seed(seed, global rank, call index, 0)``,
    the hierarchical re-quantization ``stochastic_seed(..., 1)`` (``zeropp.comm.stochastic``).
    Ignored (no index taken) when plain.
    """
    intra_bits = resolve_intra_bits(bits, intra_bits)
    base_seed = sr.check_base_seed(seed)
    gs = DEFAULT_GRAD_GROUP_SIZE if group_size is None else group_size
    plain = is_plain(bits)
    if not plain:
        check_group_size_arg(gs, [bits, intra_bits])
    topo = resolve_topology(topology)
    ranks = group_ranks(group)
    check_member(ranks, "reduce-scatter")
    W, n = len(ranks), output_tensor.numel()
    if input_tensor.numel() != W * n:
        raise ValueError(
            f"reduce-scatter input has {input_tensor.numel()} elements but output has {n} and the "
            f"group has {W} ranks; the input must hold {W} x {n} = {W * n} elements (pad it)"
        )
    check_contiguous(output_tensor, "reduce-scatter output")
    check_contiguous(input_tensor, "reduce-scatter input")
    if output_tensor.device != input_tensor.device:
        raise ValueError(f"output on {output_tensor.device} but input on {input_tensor.device}; use one device")
    op_name, factor = parse_op(op)
    stats = stats if stats is not None else _default_stats()
    if plain:
        stats.count_call(kind)
        if n == 0:
            return finish_or_handle([], None, async_op)
        return _plain_reduce_scatter(output_tensor, input_tensor, op, op_name, factor, group, ranks, topo, stats, kind, async_op)
    if op_name not in ("sum", "avg", "premul_sum"):
        raise ValueError(f"quantized reduce-scatter supports SUM, AVG and PREMUL_SUM, not {op_name.upper()}; use bits=None")
    check_float(input_tensor, "reduce-scatter input")
    check_float(output_tensor, "reduce-scatter output")
    if error_feedback is not None and not isinstance(error_feedback, qgz.ErrorFeedback):
        raise TypeError(f"error_feedback must be a zeropp.comm.ErrorFeedback, got {type(error_feedback).__name__}")
    stats.count_call(kind)
    seeds = None
    if stochastic:
        me, call = dist.get_rank(), sr.next_call()
        seeds = (sr.stochastic_seed(base_seed, me, call, 0), sr.stochastic_seed(base_seed, me, call, 1))
    if n == 0:
        return finish_or_handle([], None, async_op)
    post_scale = factor / W if op_name == "avg" else factor
    plan = qgz.QgzPlan(topo, ranks, n, bits, intra_bits, gs)
    return qgz.run(plan, output_tensor, input_tensor, post_scale, group, error_feedback, feedback_key, stats, kind,
                   async_op, seeds)


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
) -> Optional[CommHandle]:
    """Backend reduce-scatter; converts dtypes through a temporary and emulates PREMUL_SUM on gloo."""
    W = len(ranks)
    record_sends(stats, kind, topo, ranks, peer_bytes("reduce_scatter", inp.numel() * inp.element_size(), W))
    src = inp.view(-1)
    if op_name == "premul_sum" and dist.get_backend(group) == "gloo":  # gloo has no PREMUL_SUM
        src, op = src * factor, ReduceOp.SUM
    direct = out.dtype == src.dtype
    dst = out.view(-1) if direct else torch.empty(out.numel(), dtype=src.dtype, device=src.device)
    work = backend_reduce_scatter(dst, src, op, group, async_op)
    finish = None if direct else (lambda: out.view(-1).copy_(dst))
    return finish_or_handle([work], finish, async_op)


def all_reduce(
    tensor: torch.Tensor,
    op: ReduceOpLike = ReduceOp.SUM,
    group: Optional[dist.ProcessGroup] = None,
    *,
    topology: Optional[Topology] = None,
    stats: Optional[CommStats] = None,
    kind: str = "all_reduce",
    async_op: bool = False,
) -> Optional[CommHandle]:
    """Plain backend all-reduce (ZeRO stages 0-2), accounted as reduce-scatter + all-gather:
    ``2 * nbytes / W`` to each other member (see ``stats.py``)."""
    topo = resolve_topology(topology)
    ranks = group_ranks(group)
    check_member(ranks, "all-reduce")
    stats = stats if stats is not None else _default_stats()
    stats.count_call(kind)
    W = len(ranks)
    record_sends(stats, kind, topo, ranks, peer_bytes("all_reduce", tensor.numel() * tensor.element_size(), W))
    work = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    return finish_or_handle([work], None, async_op)


def quantized_all_reduce(
    tensor: torch.Tensor,
    op: ReduceOpLike = ReduceOp.AVG,
    group: Optional[dist.ProcessGroup] = None,
    *,
    bits: Optional[int] = 4,
    intra_bits: Optional[int] = None,
    gather_bits: Optional[int] = None,
    group_size: Optional[int] = None,
    gather_group_size: Optional[int] = None,
    topology: Optional[Topology] = None,
    error_feedback: Optional[qgz.ErrorFeedback] = None,
    feedback_key: str = "default",
    stats: Optional[CommStats] = None,
    kind: str = "all_reduce",
    stochastic: bool = False,
    seed: Optional[int] = None,
) -> torch.Tensor:
    """In-place all-reduce of any-size ``tensor`` as a (quantized) reduce-scatter of the
    zero-padded flat tensor followed by a (``gather_bits``-quantized, default plain) all-gather.
    Synchronous; returns ``tensor``. Both halves are recorded under ``kind``. ``stochastic`` /
    ``seed`` apply to both halves (each quantized half takes its own call index)."""
    sr.check_base_seed(seed)
    ranks = group_ranks(group)
    W, numel = len(ranks), tensor.numel()
    n = -(-numel // W)  # ceil: chunk per rank
    flat = torch.zeros(W * n, dtype=tensor.dtype, device=tensor.device)
    flat[:numel] = tensor.reshape(-1)
    chunk = torch.empty(n, dtype=tensor.dtype, device=tensor.device)
    quantized_reduce_scatter(
        chunk, flat, op, group, bits=bits, intra_bits=intra_bits, group_size=group_size, topology=topology,
        error_feedback=error_feedback, feedback_key=feedback_key, stats=stats, kind=kind,
        stochastic=stochastic, seed=seed,
    )
    quantized_all_gather(flat, chunk, group, bits=gather_bits, group_size=gather_group_size,
                         topology=topology, stats=stats, kind=kind, stochastic=stochastic, seed=seed)
    tensor.view(-1).copy_(flat[:numel]) if tensor.is_contiguous() else tensor.copy_(flat[:numel].view_as(tensor))
    return tensor


def _default_stats() -> CommStats:
    return get_comm_stats()
