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

Cross-node bytes per rank: ``(nodes - 1)`` rows at ``bits`` instead of ``rpn * (nodes - 1)``
full-precision chunks. Two quantization rounds whatever the world size. With one node, one
rank per node, or a sub-group of the world, a single quantized all-to-all + dequantize-sum.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..kernels import dequantize, dequantize_sum, dequantize_sum_requantize, quantize
from .backend import CommHandle, backend_all_to_all, finish_or_handle, pack, unpack
from .stats import CommStats, peer_bytes, record_sends
from .topology import Topology


class ErrorFeedback:
    """Error feedback (the LoCo / EF-SGD idea) for the quantized reduce-scatter.

    Each rank keeps, per bucket ``key``, the residual of *its own* first-hop quantization,
    ``r = x - dequantize(quantize(x))`` with ``x = gradient + previous r``, in fp32, and adds it to
    the next gradient of that bucket before quantizing. What one step rounds away is sent in a
    later step, so the quantization error does not accumulate in the weights. Only the first hop
    is compensated (the later re-quantization of partial sums is shared by several ranks). A
    non-finite block leaves a zero residual, so a skipped overflow step does not poison later ones.
    Residuals are laid out like the input and cost 4 bytes per gradient element.
    """

    def __init__(self) -> None:
        self._residuals: dict[str, torch.Tensor] = {}

    def residual(self, key: str, numel: int, device: torch.device) -> torch.Tensor:
        """The fp32 residual of bucket ``key`` ([numel]); zeros the first time."""
        r = self._residuals.get(key)
        if r is None:
            return torch.zeros(numel, dtype=torch.float32, device=device)
        if r.numel() != numel:
            raise ValueError(
                f"error-feedback bucket {key!r} holds {r.numel()} elements but this call has {numel}; "
                f"use one feedback_key per gradient bucket (or reset({key!r}))"
            )
        return r

    def store(self, key: str, residual: torch.Tensor) -> None:
        self._residuals[key] = torch.nan_to_num(residual.reshape(-1).float(), nan=0.0, posinf=0.0, neginf=0.0)

    def reset(self, key: Optional[str] = None) -> None:
        """Forget one bucket's residual, or all (e.g. after loading a checkpoint)."""
        if key is None:
            self._residuals.clear()
        else:
            self._residuals.pop(key, None)

    def keys(self) -> list[str]:
        return list(self._residuals)

    def nbytes(self) -> int:
        return sum(r.numel() * 4 for r in self._residuals.values())


def swizzle(x: torch.Tensor, nodes: int, rpn: int) -> torch.Tensor:
    """[W, n] chunks in rank order (``j = m*rpn + l``) -> [W, n] local-major (row ``l*nodes + m``)."""
    n = x.shape[-1]
    return x.reshape(nodes, rpn, n).transpose(0, 1).reshape(nodes * rpn, n)


def unswizzle(y: torch.Tensor, nodes: int, rpn: int) -> torch.Tensor:
    """Inverse of :func:`swizzle`."""
    n = y.shape[-1]
    return y.reshape(rpn, nodes, n).transpose(0, 1).reshape(nodes * rpn, n)


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

    @property
    def hierarchical(self) -> bool:
        t = self.topology
        return self.ranks == list(range(t.world_size)) and t.nodes > 1 and t.ranks_per_node > 1

    @property
    def single_hop_bits(self) -> int:
        t = self.topology
        one_node = len({t.node_of(r) for r in self.ranks}) == 1
        return self.intra_bits if one_node else self.bits


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
) -> Optional[CommHandle]:
    """Run ``plan`` (arguments already validated by ``quantized_reduce_scatter``). ``seeds``:
    kernel seeds of the first quantization and of the re-quantization for stochastic rounding
    (None = round to nearest)."""
    W, n, gs = len(plan.ranks), plan.n, plan.group_size
    topo = plan.topology
    x = inp.view(W, n)  # [W, n] chunk j for member j
    if ef is not None:
        x = x.float() + ef.residual(key, W * n, inp.device).view(W, n)
    if not plan.hierarchical:  # one quantized all-to-all over the group, then dequantize-sum
        bits = plan.single_hop_bits
        send = _quantize_for_send(x, bits, gs, ef, key, seed=None if seeds is None else seeds[0])  # [W, B]
        recv, work = _all_to_all(send, plan.ranks, group, topo, stats, kind, async_op)
        return finish_or_handle([work], lambda: _sum_into(recv.unsqueeze(1), n, bits, gs, post_scale, out), async_op)

    nodes, rpn = topo.nodes, topo.ranks_per_node
    groups = topo.build()
    me = dist.get_rank()
    xs = swizzle(x, nodes, rpn)  # [rpn * nodes, n]: rows l*nodes .. (l+1)*nodes go to local peer l
    send1 = _quantize_for_send(xs, plan.intra_bits, gs, ef, key, lambda r: unswizzle(r, nodes, rpn),
                               seed=None if seeds is None else seeds[0])  # [W, B1]
    recv1, work = _all_to_all(send1, topo.intra_ranks(me), groups.intra, topo, stats, kind, async_op)

    def finish() -> None:
        q_in = unpack(recv1.view(rpn, nodes, -1), n, plan.intra_bits, gs)  # [rpn sources, nodes, *]
        if seeds is None:
            q2 = dequantize_sum_requantize(q_in, plan.bits, gs)  # [nodes, *]: node sums of my-local chunks
        else:
            q2 = dequantize_sum_requantize(q_in, plan.bits, gs, stochastic=True, seed=seeds[1])
        send2 = pack(q2)  # [nodes, B2]; row m -> node m
        recv2, _ = _all_to_all(send2, topo.cross_ranks(me), groups.cross, topo, stats, kind, False)
        _sum_into(recv2.unsqueeze(1), n, plan.bits, gs, post_scale, out)

    return finish_or_handle([work], finish, async_op)


def _quantize_for_send(
    x: torch.Tensor,
    bits: int,
    gs: int,
    ef: Optional[ErrorFeedback],
    key: str,
    to_input_layout: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    *,
    seed: Optional[int] = None,
) -> torch.Tensor:
    """Quantize ``x`` ([rows, n]) row-wise and pack it for the wire ([rows, B] uint8); a ``seed``
    selects stochastic rounding with that kernel seed. With error feedback, store what the
    rounding lost, mapped back to the input's chunk order."""
    if seed is None:
        q = quantize(x, bits, gs, rows=x.shape[0])
    else:
        q = quantize(x, bits, gs, rows=x.shape[0], stochastic=True, seed=seed)
    if ef is not None:
        r = x.float() - dequantize(q)  # [rows, n]
        ef.store(key, r if to_input_layout is None else to_input_layout(r))
    return pack(q)


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
    member order) over ``group`` (members = the global ``peers``), accounted per peer."""
    recv = torch.empty_like(send)
    record_sends(stats, kind, topo, peers, peer_bytes("all_to_all", send.numel() * send.element_size(), len(peers)))
    return recv, backend_all_to_all(recv, send, group, async_op)


def _sum_into(buf: torch.Tensor, n: int, bits: int, gs: int, post_scale: float, out: torch.Tensor) -> None:
    """Packed [k, 1, B] -> fp32 sum over k, times ``post_scale``, written into ``out`` ([n])."""
    s = dequantize_sum(unpack(buf, n, bits, gs), dtype=torch.float32)  # [1, n]
    if post_scale != 1.0:
        s.mul_(post_scale)
    out.view(-1).copy_(s.view(-1))
