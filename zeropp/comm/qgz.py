"""qgZ: the hierarchical quantized reduce-scatter (ZeRO++ section 2, background.md) and its
error feedback.

Input ``[W * n]`` is W chunks of n; chunk ``j`` summed over all ranks must end on rank ``j``.
With ``rank = node * rpn + local``:

1. swizzle: reorder the chunks local-major, ``[nodes, rpn, n] -> [rpn, nodes, n]``, so the
   contiguous piece ``l`` holds the chunks of every rank with local index ``l`` (one per node);
2. quantize row-wise (one row per chunk, so n need not divide anything) at ``intra_bits``;
3. all-to-all inside the node: local peer ``l`` receives piece ``l`` from each of the rpn ranks;
4. fused dequantize-sum-requantize of the rpn received pieces (at ``bits``): row ``m`` is now
   the node's partial sum of chunk ``m * rpn + local``;
5. all-to-all across nodes (the ranks with my local index): row ``m`` goes to node ``m``;
6. dequantize-sum of the ``nodes`` partial sums = my chunk, scaled (AVG divides by the *world*
   size, unlike DeepSpeed which divides by the node count).

Steps 4-6 run as a continuation (``chain.py``): issued as soon as hop 1 has landed, on the
comm worker thread (CPU) or a side stream (CUDA), in call order, so several outstanding
reduce-scatters keep the same collective order on every rank and the caller's ``wait()`` only
waits. Hop 2's bytes are accounted at issue, on the caller's thread.

Buffer lifetimes (``lifetime.py``): hop 1's send and receive rows are allocated on the caller's
stream but last used on the continuation's (its ``wait()`` on hop 1, its re-quantization), so
the continuation owns them (``chain.submit(buffers=)``) and releases them after it ran, on its
side stream (CUDA: ``record_stream`` there; NCCL itself keeps them only until that ``wait()``):
the caller's next allocation (the next chunk's rows, the next outstanding call) cannot get
their memory while the intra-node all-to-all or the re-quantization still reads it. Hop 2's
rows live and die on the side stream; the output, written there, is marked as used by it. The
single-hop path's rows are released by the handle's ``wait()`` (``backend.CommHandle``).

Error feedback (``feedback.py``) compensates both quantization rounds, each on the rank that
performs it: step 2 adds this rank's hop-1 residual (input chunk order, the caller's key) to its
input; step 4 adds its hop-2 residual (``[nodes, n]``, key + ``HOP2_SUFFIX``) to the node sums it
re-quantizes, which no other rank quantizes. The flat single all-to-all has hop 1 only.

Cross-node bytes per rank: ``(nodes - 1)`` rows at ``bits`` instead of ``rpn * (nodes - 1)``
full-precision chunks. Two quantization rounds whatever the world size. With one node, one
rank per node, or a sub-group of the world, a single quantized all-to-all + dequantize-sum.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from zeropp.kernels import rotated_cols

from . import chain, lifetime, ranges
from .backend import CommHandle, backend_all_to_all, finish_or_handle
from .codecs import Codec, HadamardCodec
from .feedback import HOP2_SUFFIX, ErrorFeedback
from .lifetime import Buffers
from .stats import CommStats, peer_bytes, record_sends
from .topology import Topology

if TYPE_CHECKING:
    from .session import CommSession

__all__ = ["ErrorFeedback", "QgzPlan", "run", "swizzle", "swizzled_view", "unswizzle"]


def swizzle(x: torch.Tensor, nodes: int, rpn: int) -> torch.Tensor:
    """[W, n] chunks in rank order (``j = m*rpn + l``) -> [W, n] local-major (row ``l*nodes + m``)."""
    n = x.shape[-1]
    return x.reshape(nodes, rpn, n).transpose(0, 1).reshape(nodes * rpn, n)


def unswizzle(y: torch.Tensor, nodes: int, rpn: int) -> torch.Tensor:
    """Inverse of :func:`swizzle`."""
    n = y.shape[-1]
    return y.reshape(rpn, nodes, n).transpose(0, 1).reshape(nodes * rpn, n)


def swizzled_view(x: torch.Tensor, nodes: int, rpn: int) -> torch.Tensor:
    """:func:`swizzle` as a view, no copy: ``[W, n]`` (rows may be strided) -> ``[rpn, nodes, n]``
    whose flattened rows are :func:`swizzle`'s rows. The kernels index it in place
    (``zeropp.kernels.layout.row_geometry``)."""
    return x.view(nodes, rpn, x.shape[-1]).transpose(0, 1)


@dataclasses.dataclass(frozen=True)
class QgzPlan:
    """How one quantized reduce-scatter runs (decided from arguments shared by all ranks)."""

    topology: Topology
    ranks: list[int]
    """Global ranks of the group, in group order (member ``j`` gets chunk ``j``)."""
    n: int
    """Elements per chunk (= output numel)."""
    bits: int
    """Bits of the cross-node hop (and of a single hop that crosses nodes)."""
    intra_bits: int
    """Bits of the intra-node hop (and of a single hop inside one node)."""
    group_size: int
    codec: Codec
    """The spec's scheme: every quantize / pack / sum of this call goes through it."""

    @property
    def hierarchical(self) -> bool:
        """Two hops when the group is the topology's whole data-parallel world (all ranks, or with
        ``tp > 1`` those sharing a tp index) spread over several nodes with several members each."""
        t = self.topology
        return self.ranks == t.dp_ranks(self.ranks[0]) and t.nodes > 1 and t.ranks_per_node // t.tp > 1

    @property
    def one_node(self) -> bool:
        """All members on one node."""
        t = self.topology
        return len({t.node_of(r) for r in self.ranks}) == 1

    @property
    def single_hop_bits(self) -> int:
        return self.intra_bits if self.one_node else self.bits


def run(
    plan: QgzPlan,
    out: torch.Tensor,
    inp: torch.Tensor,
    post_scale: float,
    group: Optional[dist.ProcessGroup],
    ef: Optional[ErrorFeedback],
    key: str,
    stats: CommStats,
    kind: str,
    async_op: bool,
    seeds: Optional[tuple[int, int]] = None,
    name: Optional[str] = None,
    *,
    session: Optional[CommSession] = None,
) -> Optional[CommHandle]:
    """Run ``plan`` (arguments already validated by ``quantized_reduce_scatter``). ``seeds``:
    kernel seeds of the first quantization and of the re-quantization for stochastic rounding
    (None = round to nearest). ``name``: the call's profiler range (``ranges.py``); each hop runs
    in ``<name>/intra`` or ``<name>/cross`` (a single hop: ``intra`` inside one node), with its
    ``/quantize`` and ``/dequantize`` parts. ``session``: whose side stream runs hop 2 and whose
    wait hooks the handle's wait runs in (None: the default session)."""
    W, n, gs, codec = len(plan.ranks), plan.n, plan.group_size, plan.codec
    topo = plan.topology
    x = inp.view(W, n)  # [W, n] chunk j for member j (a row-strided view is read in place)
    if ef is not None:
        x = x.float() + ef.residual(key, W * n, inp.device).view(W, n)
    elif not codec.in_place and not x.is_contiguous():
        x = x.contiguous()  # a minimal codec expects a contiguous input
    seed1, seed2 = (None, None) if seeds is None else seeds
    if not plan.hierarchical:  # one quantized all-to-all over the group, then dequantize-sum
        bits = plan.single_hop_bits
        hop = None if name is None else f"{name}/{'intra' if plan.one_node else 'cross'}"
        with ranges.span(hop):
            with ranges.span(hop, "quantize"):
                send = _quantize_for_send(codec, x, bits, gs, ef, key, seed=seed1)  # [W, B]
            recv, work = _all_to_all(send, plan.ranks, group, topo, stats, kind, async_op)

        def finish() -> None:
            with ranges.span(hop, "dequantize"):
                _sum_into(codec, recv.unsqueeze(1), n, bits, gs, post_scale, out)

        return finish_or_handle(
            [work], finish, async_op, Buffers(send, recv, protect=(inp, out)), session=session, kind=kind
        )

    nodes, rpn = topo.nodes, topo.ranks_per_node // topo.tp  # the group's members per node
    groups = topo.build()
    me = dist.get_rank()
    # [rpn, nodes, n]: rows l*nodes .. (l+1)*nodes go to local peer l. For an in-place codec this
    # stays a view: the quantization reads x in swizzled order and writes each row straight
    # into its slot of the send buffer, so no swizzled copy of x is made.
    at_intra, at_cross = (None, None) if name is None else (f"{name}/intra", f"{name}/cross")  # hops' ranges
    with ranges.span(at_intra):
        xs = swizzled_view(x, nodes, rpn) if codec.in_place else swizzle(x, nodes, rpn)
        with ranges.span(at_intra, "quantize"):
            send1 = _quantize_for_send(codec, xs, plan.intra_bits, gs, ef, key, (nodes, rpn), seed=seed1)  # [W, B1]
        recv1, work = _all_to_all(send1, topo.intra_ranks(me), groups.intra, topo, stats, kind, True)
    # hop 2's size is known now: account it here, on the caller's thread, in issue order
    B2 = codec.wire_bytes(n, plan.bits, gs)
    cross = topo.cross_ranks(me)
    record_sends(stats, kind, topo, cross, peer_bytes("all_to_all", nodes * B2, len(cross)))

    # hop 1's rows: the continuation's to release (after it ran, on its stream); `out` is written there
    hold = Buffers(send1, recv1, protect=(inp, out), borrowed=(out,))

    def hop2() -> None:
        # runs as soon as hop 1 has landed (chain.py), not in the caller's wait()
        work.wait()
        lifetime.completed()
        with ranges.span(at_cross):
            _hop2()

    def _hop2() -> None:
        # [rpn sources, nodes, B1] -> [nodes, B2]: node sums of my-local chunks; row m -> node m
        with ranges.span(at_cross, "quantize"):  # hop 1's dequantize-sum fused with hop 2's quantization
            if ef is None:
                send2 = codec.dequantize_sum_requantize(
                    recv1.view(rpn, nodes, -1), n, plan.intra_bits, gs, out_bits=plan.bits, seed=seed2
                )
            else:
                send2 = _requantize_with_feedback(
                    codec, recv1.view(rpn, nodes, -1), n, plan.intra_bits, plan.bits, gs, ef, key + HOP2_SUFFIX, seed2
                )
        if tuple(send2.shape) != (nodes, B2) or send2.dtype != torch.uint8:
            raise RuntimeError(
                f"codec {type(codec).__name__} re-quantized to {send2.dtype} {tuple(send2.shape)}; its "
                f"wire_bytes says uint8 ({nodes}, {B2})"
            )
        recv2 = torch.empty_like(send2)  # [nodes, B2]
        hold.add(send2, recv2)
        backend_all_to_all(recv2, send2, groups.cross, False)
        with ranges.span(at_cross, "dequantize"):
            _sum_into(codec, recv2.unsqueeze(1), n, plan.bits, gs, post_scale, out)

    later = chain.submit(hop2, out.device, buffers=hold, session=session)
    return finish_or_handle([later], None, async_op, session=session, kind=kind)  # its wait takes the timeout


def _quantize_for_send(
    codec: Codec,
    x: torch.Tensor,
    bits: int,
    gs: int,
    ef: Optional[ErrorFeedback],
    key: str,
    swizzled: Optional[tuple[int, int]] = None,
    *,
    seed: Optional[int] = None,
) -> torch.Tensor:
    """Quantize ``x`` ([rows, n], or the ``[rpn, nodes, n]`` swizzled view) row-wise into wire
    rows ([rows, B] uint8, on x's device; the codec writes them in place); a ``seed`` selects
    stochastic rounding with that kernel seed. With error feedback, store what the rounding
    lost, in the input's chunk order (``swizzled`` = ``(nodes, rpn)`` when ``x`` is swizzled)."""
    n = x.shape[-1]
    rows = x.numel() // n if n else x.shape[0]
    send = codec.encode(x, bits, gs, rows=rows, seed=seed)
    if ef is None:
        return send
    q = codec.unpack(send, n, bits, gs)  # views of send for an in-place codec
    if swizzled is None:
        r = x.float() - codec.dequantize(q).view(x.shape)  # [rows, n]
    elif codec.in_place:
        nodes, rpn = swizzled
        r = torch.empty(nodes, rpn, n, dtype=torch.float32, device=x.device)  # input chunk order
        for l in range(rpn):  # send rows l*nodes .. (l+1)*nodes hold input chunks m*rpn + l
            rows_l = type(q)(
                q.codes[l * nodes : (l + 1) * nodes],
                q.scales[l * nodes : (l + 1) * nodes],
                q.cols,
                q.bits,
                q.group_size,
            )
            codec.dequantize(rows_l, out=r[:, l, :])  # [nodes, n] row-strided, written in place
        r = torch.sub(x.transpose(0, 1).reshape(nodes, rpn, n), r, out=r)  # x is fp32 and contiguous under EF
    else:
        r = unswizzle(x.float() - codec.dequantize(q).view(x.shape), *swizzled)
    ef.store(key, r)
    return send


def _reduction_basis(codec: Codec, n: int, gs: int) -> tuple[Codec, int]:
    """The codec whose rows qgZ sums and re-quantizes between its hops, and their length: a
    Hadamard codec reduces in the rotated basis (its inner int codec over the rotated row, as
    its fused ``dequantize_sum_requantize`` does), any other codec in its own."""
    if isinstance(codec, HadamardCodec):
        return codec.inner, rotated_cols(n, codec.block_for(gs))
    return codec, n


def _requantize_with_feedback(
    codec: Codec,
    recv: torch.Tensor,
    n: int,
    in_bits: int,
    out_bits: int,
    gs: int,
    ef: ErrorFeedback,
    key: str,
    seed: Optional[int],
) -> torch.Tensor:
    """Hop 2 with error feedback: received rows ``uint8 [rpn, nodes, B1]`` -> node partial sums
    ``p`` ([nodes, c] fp32, c = n, or the rotated length for a Hadamard codec), ``p += r2`` (this
    rank's hop-2 residual under ``key``), re-quantized into wire rows ``[nodes, B2]``; stores
    ``r2 = p - dq(q(p))``. With a zero residual this is bit for bit the fused
    ``dequantize_sum_requantize`` (the kernels' reference defines the fused kernel as exactly
    this sum followed by ``quantize``, same seed)."""
    base, c = _reduction_basis(codec, n, gs)
    nodes = recv.shape[1]
    p = base.dequantize_sum(recv, c, in_bits, gs)  # [nodes, c] fp32, summed over the rpn sources
    p = p.view(nodes, c).add_(ef.residual(key, nodes * c, p.device).view(nodes, c))
    send2 = base.encode(p, out_bits, gs, rows=nodes, seed=seed)  # [nodes, B2]
    ef.store(key, p.sub_(base.dequantize(base.unpack(send2, c, out_bits, gs)).view(nodes, c)))
    return send2


def _all_to_all(
    send: torch.Tensor,
    peers: list[int],
    group: Optional[dist.ProcessGroup],
    topo: Topology,
    stats: CommStats,
    kind: str,
    async_op: bool,
) -> tuple[torch.Tensor, Optional[dist.Work]]:
    """Equal-split all-to-all of ``send`` ([rows, B], ``rows / len(peers)`` rows per member, in
    member order) over ``group`` (members = the global ``peers``), accounted per peer. The
    receive buffer is allocated on ``send``'s device (the group's device under NCCL)."""
    recv = torch.empty_like(send)
    record_sends(stats, kind, topo, peers, peer_bytes("all_to_all", send.numel() * send.element_size(), len(peers)))
    return recv, backend_all_to_all(recv, send, group, async_op)


def _sum_into(
    codec: Codec, buf: torch.Tensor, n: int, bits: int, gs: int, post_scale: float, out: torch.Tensor
) -> None:
    """Wire rows [k, 1, B] -> fp32 sum over k, times ``post_scale``, written into ``out`` ([n]).

    An fp32 ``out`` of a codec that sums into one (``in_place`` or ``sums_into``) receives the sum
    directly (read from ``buf`` in place) and is scaled there: the same fp32 operations as through a
    temporary. A bf16/fp16 ``out`` needs the fp32 sum scaled *before* its single rounding, so it
    goes through an fp32 [n]."""
    if (codec.in_place or codec.sums_into) and out.dtype == torch.float32 and out.is_contiguous():
        codec.dequantize_sum(buf, n, bits, gs, dtype=torch.float32, out=out)
        if post_scale != 1.0:
            out.mul_(post_scale)
        return
    s = codec.dequantize_sum(buf, n, bits, gs, dtype=torch.float32)  # [1, n]
    if post_scale != 1.0:
        s.mul_(post_scale)
    out.view(-1).copy_(s.view(-1))
