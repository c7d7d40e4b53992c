"""The public collectives: qwZ all-gather, qgZ reduce-scatter, all-reduce, all with byte accounting.

Each lives in its role module (``gather.py``: the all-gather; ``reduce_scatter.py``: the
reduce-scatter; ``plain.py``: the backend paths and ``all_reduce``) and is imported from here, the
home of the rules below that they all keep; the all-reduce of the two halves is here.

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

from typing import Optional

import torch
import torch.distributed as dist

from . import callcheck
from .backend import ReduceOpLike, check_gather_spec, check_member, check_reduce_spec, parse_op
from .feedback import ErrorFeedback
from .gather import quantized_all_gather
from .kinds import CommKind
from .lifetime import Buffers
from .plain import all_reduce, rank_order_sum
from .reduce_scatter import quantized_reduce_scatter
from .session import CommSession
from .session import resolve as resolve_session
from .spec import QuantSpec
from .stats import CommStats, group_ranks
from .topology import Topology

__all__ = ["all_reduce", "quantized_all_gather", "quantized_all_reduce", "quantized_reduce_scatter", "rank_order_sum"]

ReduceOp = dist.ReduceOp


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
