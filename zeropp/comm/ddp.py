"""DDP plug-in: a comm hook that all-reduces each gradient bucket as a quantized reduce-scatter
(qgZ, hierarchical over a multi-node topology) followed by an all-gather of the reduced chunks.

Usage::

    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(QuantizedAllReduceState(grads=QuantSpec(bits=4), topology=topo), quantized_allreduce_hook)

DDP hands the hook a flat bucket whose size need not divide the world size; the bucket is
zero-padded to a multiple of it (``quantized_all_reduce``). The result is the *average* over
the group, as DDP's default hook gives.

The hook returns at once with a future that completes when the bucket's reduce-scatter and
all-gather have finished, so DDP keeps computing the backward of earlier layers and hands over
later buckets meanwhile (it waits for all futures at the end of backward, then copies the
buckets back into ``param.grad``). The all-reduce runs as a continuation (``chain.py``): on
CPU on the comm worker thread, bucket after bucket in DDP's order (the same on every rank); on
CUDA on a side stream, the future being device-aware.
"""

# No ``from __future__ import annotations`` here: DDP checks the hook's annotations as objects.
import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

from zeropp.kernels.layout import QUANT_FLOAT_DTYPES

from .backend import check_gather_spec, check_reduce_spec, check_spec_type
from .chain import submit_future
from .collectives import quantized_all_reduce
from .feedback import ErrorFeedback
from .fsdp import make_session
from .kinds import CommKind
from .session import CommSession
from .spec import QuantSpec
from .stats import CommStats
from .topology import Topology


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizedAllReduceState:
    """Settings (and error-feedback state) of :func:`quantized_allreduce_hook`."""

    grads: Optional[QuantSpec]
    """Spec of the gradient reduce-scatter (qgZ; per-hop bits, error feedback, rounding). None =
    the plain reduce-scatter (still byte-accounted), which reproduces DDP's own all-reduce."""
    gather: Optional[QuantSpec] = None
    """Spec of the all-gather of the reduced chunks (None = plain, in the bucket's dtype); a
    one-hop gather, so it may not set ``intra_bits`` or ``error_feedback``."""
    group: Optional[dist.ProcessGroup] = None
    """Process group of the DDP model (None = the default group)."""
    topology: Optional[Topology] = None
    """Topology for routing and accounting (None = the process-wide default); only without ``session``."""
    stats: Optional[CommStats] = None
    """Where bytes are recorded (None = the session's own CommStats); only without ``session``."""
    session: Optional[CommSession] = None
    """The hook's communication state: stats, stochastic-rounding counter, side streams, wait hooks
    (None: a new :class:`CommSession` over ``topology`` / ``stats``, this state's own)."""
    kind: str = CommKind.DDP_ALL_REDUCE
    """Name the bytes are recorded under."""
    feedback: Optional[ErrorFeedback] = dataclasses.field(default=None, init=False, repr=False, compare=False)
    """Residuals of ``grads.error_feedback`` (created here, at ``grads.residual_bits``). Save
    ``feedback.state_dict()`` per rank with a checkpoint and ``load_state_dict`` it on resume for
    an exact continuation, or ``reset()`` it to start the residuals over."""

    def __post_init__(self) -> None:
        check_spec_type(self.grads, "grads")
        check_gather_spec(self.gather, "gather")  # fail here, not in the first backward
        if self.grads is not None and self.grads.error_feedback:
            object.__setattr__(self, "feedback", ErrorFeedback.for_spec(self.grads))
        check_reduce_spec(self.grads, self.feedback, "grads")
        object.__setattr__(
            self, "session", make_session(self.session, self.topology, self.stats, "QuantizedAllReduceState")
        )
        if not isinstance(self.kind, str) or not self.kind:
            raise ValueError(f"QuantizedAllReduceState.kind must be a non-empty string, got {self.kind!r}")


def quantized_allreduce_hook(
    state: QuantizedAllReduceState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket.buffer()`` over the group with quantized collectives, in place; the
    returned future completes (with the buffer) once both collectives have finished. A bucket
    that a quantized spec cannot take (float64) is a ValueError raised from the backward."""
    buf = bucket.buffer()
    if not dist.is_initialized():
        # refused here, on DDP's calling thread: raised in the continuation, DDP would report the error
        # as "Unable to cast <message> to Tensor"
        raise RuntimeError(
            "quantized_allreduce_hook: the default process group was destroyed (destroy_process_group); this "
            "DDP model and its QuantizedAllReduceState belong to it: after a new init_process_group, wrap the "
            "model in a new DDP and register the hook with a new state"
        )
    if state.group is not None and dist.get_rank(state.group) < 0:  # likewise refused on the calling thread
        raise ValueError(
            f"quantized_allreduce_hook: rank {dist.get_rank()} is not in QuantizedAllReduceState.group (ranks "
            f"{dist.get_process_group_ranks(state.group)}); pass the DDP model's own process group, or None for the "
            f"default group"
        )
    if (state.grads is not None or state.gather is not None) and buf.dtype not in QUANT_FLOAT_DTYPES:
        # refused here, on DDP's calling thread (the same on every rank): raised in the continuation,
        # the error would reach DDP only as its future's value, which DDP reports as a failed cast
        raise ValueError(
            f"quantized_allreduce_hook: DDP's gradient bucket {bucket.index()} is {buf.dtype}, but quantized "
            f"collectives take float32, bfloat16 or float16; keep the model in one of those dtypes, or use "
            f"QuantizedAllReduceState(grads=None, gather=None) (a plain all-reduce) for {buf.dtype} gradients"
        )
    # DDP may rebuild its buckets after the first iteration: key residuals by index *and* size.
    key = f"bucket{bucket.index()}:{buf.numel()}"

    def reduce() -> None:
        quantized_all_reduce(
            buf,
            dist.ReduceOp.AVG,
            state.group,
            spec=state.grads,
            gather_spec=state.gather,
            error_feedback=state.feedback,
            feedback_key=key,
            kind=state.kind,
            session=state.session,
        )

    return submit_future(reduce, buf, session=state.session)
