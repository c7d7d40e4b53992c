"""Shared helpers of the comm tests: deterministic per-rank inputs, references computed from the
kernels' torch reference, error bounds derived from the block scales, and the analytic byte
volumes that the accounting must reproduce exactly.

Every rank can regenerate every other rank's input (seeded by rank), so each rank can check its
result against a reference built from the whole world's data without extra communication.
"""

from __future__ import annotations

import math

import torch

from tests.kernel_helpers import stack
from zeropp.comm import QuantSpec, Topology
from zeropp.comm.codecs import Codec, IntCodec, codec_for
from zeropp.comm.context import DEBUG_COLLECTIVES_ENV
from zeropp.kernels import dequantize_sum, dequantize_sum_requantize, quantize, quantized_nbytes

CHECK_CALLS_ENV = {DEBUG_COLLECTIVES_ENV: "1"}
"""``run_world(..., env=CHECK_CALLS_ENV)``: the world runs in the collectives debug mode
(``zeropp.comm.callcheck``). Some launches of the comm tests run in it, so that every public
collective's check is exercised on real worlds (sub-groups, qgZ's hops, the DDP hook's calls on
the comm worker) and shown to change no result, at no extra launch."""

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
REL_ROUND = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
"""Half an ulp, relative: the rounding of a result stored in each dtype."""


def spec_of(bits, intra_bits=None, group_size=None):
    """The spec of a (bits, intra_bits, group_size) test case; ``bits=None`` is the plain
    collective (``spec=None``)."""
    return None if bits is None else QuantSpec(bits=bits, intra_bits=intra_bits, group_size=group_size)


def rank_input(seed: int, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A rank's test tensor: normal values whose magnitude varies by chunk of 64 (so blocks have
    different scales) and a few exact zeros."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(numel, generator=g)
    mag = torch.exp(torch.randn(math.ceil(numel / 64), generator=g)).repeat_interleave(64)[:numel]
    x = x * mag
    x[::97] = 0.0
    return x.to(dtype)


def block_absmax(x: torch.Tensor, gs: int) -> torch.Tensor:
    """[rows, cols] -> per-element absmax of its block (fp32, same shape)."""
    rows, cols = x.shape
    g = math.ceil(cols / gs)
    pad = torch.zeros(rows, g * gs)
    pad[:, :cols] = x.float().abs()
    return pad.view(rows, g, gs).amax(-1).repeat_interleave(gs, dim=1)[:, :cols]


def qmax(bits: int) -> int:
    return 2 ** (bits - 1) - 1


def simulate_qgz(
    inputs: list[torch.Tensor], topo: Topology, j: int, n: int, bits: int, intra_bits: int, gs: int
) -> torch.Tensor:
    """Bit-exact expected SUM of chunk ``j`` by the hierarchical algorithm, built from the kernels:
    each rank quantizes its chunk, each node sums its ranks' chunks in local order and
    re-quantizes, the node sums are dequantized and summed in node order. fp32 [n]."""
    rpn = topo.ranks_per_node
    chunks = [x.view(-1, n)[j : j + 1] for x in inputs]  # per rank [1, n]
    if topo.nodes == 1 or rpn == 1:
        b = intra_bits if topo.nodes == 1 else bits
        qs = [quantize(c, b, gs, rows=1) for c in chunks]
        return dequantize_sum(stack(qs)).view(-1)
    node_sums = []
    for m in range(topo.nodes):
        qs = [quantize(chunks[m * rpn + l], intra_bits, gs, rows=1) for l in range(rpn)]
        node_sums.append(dequantize_sum_requantize(stack(qs), bits, gs))
    return dequantize_sum(stack(node_sums)).view(-1)


def qgz_error_bound(
    inputs: list[torch.Tensor], topo: Topology, j: int, n: int, bits: int, intra_bits: int, gs: int
) -> torch.Tensor:
    """Per-element bound on |qgZ SUM - exact SUM| for chunk ``j``, from the block scales:
    each first-hop quantization errs by at most half a step, ``A_r / (2 qmax)`` (A_r = the block's
    absmax on rank r); a node's partial sum has absmax <= sum_r A_r (1 + 1/(2 qmax1)) and its
    re-quantization errs by half of that step. Half-steps add up over ranks and nodes."""
    A = [block_absmax(x.view(-1, n)[j : j + 1], gs).view(-1) for x in inputs]
    hierarchical = topo.nodes > 1 and topo.ranks_per_node > 1
    q1 = qmax(intra_bits if hierarchical or topo.nodes == 1 else bits)
    total_A = torch.stack(A).sum(0)
    bound = total_A / (2 * q1)
    if hierarchical:
        bound = bound + total_A * (1 + 1 / (2 * q1)) / (2 * qmax(bits))
    return bound + total_A * 1e-5  # fp32 arithmetic slack


def wire(n: int, bits: int, gs: int, spec: QuantSpec | None = None) -> int:
    """Bytes of one quantized row of n elements (codes + scales): the int layout, or the wire row
    of ``spec``'s codec when given."""
    if spec is not None:
        return codec_for(spec).wire_bytes(n, bits, gs)
    return quantized_nbytes(1, n, bits, gs)


def expected_all_gather_bytes(
    topo: Topology, n: int, elem_bytes: int, bits=None, gs: int = 512, spec: QuantSpec | None = None
) -> dict[str, int]:
    """World all-gather: my message to each of the other rpn-1 node peers and W-rpn remote ranks."""
    msg = n * elem_bytes if bits is None else wire(n, bits, gs, spec)
    return {"intra": (topo.ranks_per_node - 1) * msg, "cross": (topo.world_size - topo.ranks_per_node) * msg}


def expected_reduce_scatter_bytes(
    topo: Topology, n: int, elem_bytes: int, bits=None, intra_bits=None, gs: int = 128, spec: QuantSpec | None = None
) -> dict[str, int]:
    """World reduce-scatter. Plain: one chunk to every other rank. qgZ: hop 1 sends ``nodes`` rows
    to each of the rpn-1 node peers; hop 2 one row to each of the nodes-1 remote peers."""
    W, rpn, nodes = topo.world_size, topo.ranks_per_node, topo.nodes
    if bits is None:
        return {"intra": (rpn - 1) * n * elem_bytes, "cross": (W - rpn) * n * elem_bytes}
    ib = bits if intra_bits is None else intra_bits
    if nodes == 1:
        return {"intra": (W - 1) * wire(n, ib, gs, spec), "cross": 0}
    if rpn == 1:
        return {"intra": 0, "cross": (W - 1) * wire(n, bits, gs, spec)}
    return {"intra": (rpn - 1) * nodes * wire(n, ib, gs, spec), "cross": (nodes - 1) * wire(n, bits, gs, spec)}


def bytes_of(stats, kind: str) -> dict[str, int]:
    return stats.snapshot().get(kind, {"intra": 0, "cross": 0})


def generic_encode(c: IntCodec, x: torch.Tensor, bits: int, gs: int, rows: int, seed: int | None) -> torch.Tensor:
    """``x`` through the generic ``pack(quantize(x))`` path of ``Codec`` (what the ``int`` codec did
    before its in-place wire path): the reference of that path's bytes."""
    return Codec.encode(c, x, bits, gs, rows=rows, seed=seed)
