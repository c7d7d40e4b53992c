"""qwZ: the all-gather, quantized by a :class:`~.spec.QuantSpec` or plain (``spec=None``).

Public through ``zeropp.comm`` (and ``zeropp.comm.collectives``), whose module docstring holds the
rules every collective keeps: devices, buffer lifetimes, sessions, autograd, the call contract.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from zeropp.kernels import DEFAULT_WEIGHT_GROUP_SIZE

from . import callcheck, ranges
from . import stochastic as sr
from .backend import (
    CommHandle,
    backend_all_gather,
    check_float,
    check_gather_spec,
    check_member,
    check_plain_dtypes,
    check_rows,
    finish_or_handle,
)
from .codecs import codec_for
from .kinds import CommKind
from .lifetime import Buffers
from .plain import PlainCall, plain_all_gather
from .session import CommSession
from .session import resolve as resolve_session
from .spec import QuantSpec
from .stats import CommStats, group_ranks, peer_bytes, record_sends
from .topology import Topology


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
    that (``collectives.py``, ``callcheck.py``).

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
    name = ranges.call_range(name, kind)
    output_tensor, input_tensor = output_tensor.detach(), input_tensor.detach()  # autograd rule (collectives.py)
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
        check_rows(output_tensor, W, n, spec, "all-gather output", written=True)
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
        call = PlainCall(group=group, ranks=ranks, topo=topo, stats=stats, kind=kind, async_op=async_op, session=sess)
        return plain_all_gather(output_tensor, input_tensor, call)

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
