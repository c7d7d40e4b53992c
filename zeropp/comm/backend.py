"""Shared plumbing of the collectives: backend calls, async handles, argument checks, wire packing.

Every check here depends only on arguments that all ranks share (sizes, dtypes, bits, the
topology, the group), so a bad call raises the same error on every rank *before* any message
is sent: no rank is left waiting in a collective that its peers never entered.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from ..kernels import QuantizedTensor, SUPPORTED_BITS, num_groups, row_bytes
from ..kernels.layout import QUANT_FLOAT_DTYPES, check_group_size

PLAIN_BITS = (None, 16, 32)
"""``bits`` values meaning "no quantization": the plain backend collective is used."""

ReduceOpLike = Union[dist.ReduceOp, "dist.ReduceOp.RedOpType"]
"""``ReduceOp.SUM`` / ``AVG`` (enum values) or a ``ReduceOp`` object such as ``PREMUL_SUM(f)``."""


# ---------------------------------------------------------------------------------- handles
class CommHandle(dist.Work):
    """Async result of a zeropp collective: ``wait()`` waits for the backend messages, then runs
    the local post-processing (dequantize, sum, later hops) that writes the output.

    Subclasses ``dist.Work`` so callers that test ``isinstance(work, dist.Work)`` (FSDP2) treat it
    as the async work it is. ``is_completed()`` is True once ``wait()`` has written the output.
    Later hops of a multi-hop collective are issued inside ``wait()``, so every rank must call
    ``wait()`` on its handles in the same order (as SPMD programs do).
    """

    def __init__(self, works: Sequence[Optional[dist.Work]], finish: Optional[Callable[[], None]] = None) -> None:
        super().__init__()
        self._works = [w for w in works if w is not None]
        self._finish = finish
        self._done = False

    def wait(self, timeout: object = None) -> bool:  # noqa: ARG002 - signature of dist.Work.wait
        if not self._done:
            for w in self._works:
                w.wait()
            if self._finish is not None:
                self._finish()
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done


def finish_or_handle(
    works: Sequence[Optional[dist.Work]], finish: Optional[Callable[[], None]], async_op: bool
) -> Optional[CommHandle]:
    """``async_op``: return a handle that finishes on ``wait()``; otherwise finish now, return None."""
    h = CommHandle(works, finish)
    if async_op:
        return h
    h.wait()
    return None


# ---------------------------------------------------------------------------------- backend
def backend_all_gather(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool):
    """``all_gather_single`` (torch >= 2.13) or ``all_gather_into_tensor`` (older)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def backend_reduce_scatter(out: torch.Tensor, inp: torch.Tensor, op, group, async_op: bool):
    """``reduce_scatter_single`` (torch >= 2.13) or the deprecated ``reduce_scatter_tensor``."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, op=op, group=group, async_op=async_op)


def backend_all_to_all(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool):
    """Equal-split all-to-all: chunk ``i`` of ``inp`` (dim 0) goes to group rank ``i``."""
    return dist.all_to_all_single(out, inp, group=group, async_op=async_op)


# ---------------------------------------------------------------------------------- checks
def is_plain(bits: Optional[int]) -> bool:
    return bits in PLAIN_BITS


def check_bits_arg(bits: Optional[int], name: str = "bits") -> None:
    if bits not in PLAIN_BITS and bits not in SUPPORTED_BITS:
        raise ValueError(
            f"{name}={bits!r} is not supported; use one of {SUPPORTED_BITS} to quantize, or None "
            f"(16/32 mean the same) for the plain collective"
        )


def resolve_intra_bits(bits: Optional[int], intra_bits: Optional[int]) -> Optional[int]:
    """Check a reduce-scatter's ``bits`` / ``intra_bits`` pair; return the intra hop's bits.

    ``intra_bits=None`` means "as ``bits``". A plain value on one side and a quantized value on
    the other is refused rather than silently ignored: ``bits=None, intra_bits=8`` would run a plain
    reduce-scatter, and ``bits=4, intra_bits=16`` would quantize the intra-node hop to 4 bits,
    though the caller asked for it unquantized (qgZ has no unquantized intra-node hop).
    """
    check_bits_arg(bits)
    check_bits_arg(intra_bits, "intra_bits")
    if intra_bits is None:
        return bits
    if is_plain(bits) and not is_plain(intra_bits):
        raise ValueError(
            f"intra_bits={intra_bits} has no effect with bits={bits!r} (a plain reduce-scatter); "
            f"set bits to quantize, or intra_bits=None"
        )
    if not is_plain(bits) and is_plain(intra_bits):
        raise ValueError(
            f"intra_bits={intra_bits} asks for an unquantized intra-node hop, which qgZ does not have "
            f"(its intra-node hop is quantized); use intra_bits=None (= bits={bits}), 8 or 4, or bits=None"
        )
    return bits if is_plain(intra_bits) else intra_bits


def check_group_size_arg(group_size: int, bits_list: Sequence[Optional[int]]) -> None:
    for b in bits_list:
        if b in SUPPORTED_BITS:
            check_group_size(group_size, b)


def check_float(t: torch.Tensor, what: str) -> None:
    if t.dtype not in QUANT_FLOAT_DTYPES:
        raise ValueError(
            f"{what} has dtype {t.dtype}; quantized collectives take float32, bfloat16 or float16 "
            f"(pass bits=None for a plain collective of other dtypes)"
        )


def check_contiguous(t: torch.Tensor, what: str) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous (got strides {tuple(t.stride())}); pass t.contiguous()")


def check_member(ranks: list[int], what: str) -> None:
    me = dist.get_rank()
    if me not in ranks:
        raise ValueError(f"rank {me} is not a member of the {what} group {ranks}; only members may call it")


def parse_op(op: ReduceOpLike) -> tuple[str, float]:
    """ReduceOp -> ("sum" | "avg" | "premul_sum" | other name, factor). PREMUL_SUM carries its factor."""
    code = op.op if isinstance(op, dist.ReduceOp) and hasattr(op, "op") and op.op is not None else op
    if code == dist.ReduceOp.SUM:
        return "sum", 1.0
    if code == dist.ReduceOp.AVG:
        return "avg", 1.0
    if code == dist.ReduceOp.PREMUL_SUM:
        f = op.factor
        return "premul_sum", float(f.item() if isinstance(f, torch.Tensor) else f)
    return str(code).split(".")[-1].lower(), 1.0


# ---------------------------------------------------------------------------------- wire format
def wire_row_bytes(cols: int, bits: int, group_size: int) -> int:
    """Bytes of one packed quantized row: codes then fp32 scales (= kernels.quantized_nbytes(1, ...))."""
    return row_bytes(cols, bits, group_size) + 4 * num_groups(cols, group_size)


def pack(q: QuantizedTensor) -> torch.Tensor:
    """QuantizedTensor [..., rows, *] -> uint8 [..., rows, row_bytes + 4*groups]: one message
    per hop instead of two (codes and scales travel together)."""
    return torch.cat([q.codes.view(torch.uint8), q.scales.contiguous().view(torch.uint8)], dim=-1)


def unpack(buf: torch.Tensor, cols: int, bits: int, group_size: int) -> QuantizedTensor:
    """Inverse of :func:`pack` for a buffer [..., rows, wire_row_bytes]."""
    rb = row_bytes(cols, bits, group_size)
    codes = buf[..., :rb].contiguous()
    codes = codes.view(torch.int8) if bits == 8 else codes
    scales = buf[..., rb:].contiguous().view(torch.float32)
    return QuantizedTensor(codes, scales, cols, bits, group_size)
