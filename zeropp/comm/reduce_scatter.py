"""qgZ: the reduce-scatter, quantized by a :class:`~.spec.QuantSpec` (one all-to-all, or the
hierarchical two hops of ``qgz.py``) or plain (``spec=None``, ``plain.py``).

Imported by ``zeropp.comm.collectives`` (and exported by ``zeropp.comm``); the rules it keeps with
every collective (devices, buffer lifetimes, sessions, autograd, the call contract) are written
there once.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from zeropp.kernels import DEFAULT_GRAD_GROUP_SIZE

from . import callcheck, qgz, ranges
from . import stochastic as sr
from .backend import (
    CommHandle,
    ReduceOpLike,
    check_contiguous,
    check_float,
    check_member,
    check_op_dtype,
    check_plain_dtypes,
    check_reduce_spec,
    check_rows,
    finish_or_handle,
    parse_op,
)
from .codecs import codec_for
from .feedback import ErrorFeedback
from .kinds import CommKind
from .plain import PlainCall, plain_reduce_scatter
from .session import CommSession
from .session import resolve as resolve_session
from .spec import QuantSpec
from .stats import CommStats, group_ranks
from .topology import Topology

ReduceOp = dist.ReduceOp


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
    ``ZEROPP_DEBUG_COLLECTIVES=1`` checks that (``collectives.py``, ``callcheck.py``).

    Error feedback: ``spec.error_feedback=True`` *and* a caller-owned :class:`ErrorFeedback` in
    ``error_feedback``, with one ``feedback_key`` per gradient bucket (see ``feedback.py``); one
    without the other is a ValueError.

    ``spec.rounding="stochastic"``: the call takes the next index of its session's counter
    (shared with its :func:`~.gather.quantized_all_gather` calls); this rank's first quantization uses the kernel seed
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
    name = ranges.call_range(name, kind)
    output_tensor, input_tensor = output_tensor.detach(), input_tensor.detach()  # autograd rule (collectives.py)
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
        check_rows(input_tensor, W, n, spec, "reduce-scatter input")
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
            plain = PlainCall(
                group=group, ranks=ranks, topo=topo, stats=stats, kind=kind, async_op=async_op, session=sess
            )
            return plain_reduce_scatter(output_tensor, input_tensor, op, op_name, factor, plain)
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
