"""DDP plug-in: a comm hook that all-reduces each gradient bucket as a quantized reduce-scatter
(qgZ, hierarchical over a multi-node topology) followed by an all-gather of the reduced chunks.

Usage::

    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(QuantizedAllReduceState(bits=4, topology=topo), quantized_allreduce_hook)

DDP hands the hook a flat bucket whose size need not divide the world size; the bucket is
zero-padded to a multiple of it (``quantized_all_reduce``). The result is the *average* over
the group, as DDP's default hook gives. The hook runs synchronously and returns a completed
Future (DDP then copies the bucket back into ``param.grad``).
"""

# No ``from __future__ import annotations`` here: DDP checks the hook's annotations as objects.
import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

from .backend import check_bits_arg, resolve_intra_bits
from .collectives import quantized_all_reduce
from .qgz import ErrorFeedback
from .stochastic import check_base_seed
from .stats import CommStats
from .topology import Topology


@dataclasses.dataclass
class QuantizedAllReduceState:
    """Settings (and error-feedback state) of :func:`quantized_allreduce_hook`."""

    bits: Optional[int] = 4
    """Bits of the reduce-scatter's cross-node hop (None = plain reduce-scatter)."""
    intra_bits: Optional[int] = None
    """Bits of its intra-node hop (None = ``bits``)."""
    gather_bits: Optional[int] = None
    """Bits of the all-gather of the reduced chunks (None = plain, in the bucket's dtype)."""
    group_size: Optional[int] = None
    """Elements per scale of the reduce-scatter (None = 128)."""
    group: Optional[dist.ProcessGroup] = None
    """Process group of the DDP model (None = the default group)."""
    topology: Optional[Topology] = None
    """Topology for routing and accounting (None = the process-wide default)."""
    stats: Optional[CommStats] = None
    """Where bytes are recorded (None = the process-wide CommStats)."""
    error_feedback: bool = False
    """Keep each rank's first-hop quantization residual per bucket (LoCo-style)."""
    kind: str = "ddp_all_reduce"
    stochastic: bool = False
    """Stochastic (unbiased) rounding in both quantized halves; seed rule: ``quantized_all_gather``."""
    seed: Optional[int] = None
    """Base seed of the stochastic rounding (None = 0; an int in [0, 2**63))."""
    feedback: Optional[ErrorFeedback] = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        resolve_intra_bits(self.bits, self.intra_bits)  # fail here, not in the first backward
        check_bits_arg(self.gather_bits, "gather_bits")
        check_base_seed(self.seed)
        if self.error_feedback and self.feedback is None:
            self.feedback = ErrorFeedback()


def quantized_allreduce_hook(
    state: QuantizedAllReduceState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket.buffer()`` over the group with quantized collectives, in place."""
    buf = bucket.buffer()
    # DDP may rebuild its buckets after the first iteration: key residuals by index *and* size.
    key = f"bucket{bucket.index()}:{buf.numel()}"
    quantized_all_reduce(
        buf, dist.ReduceOp.AVG, state.group, bits=state.bits, intra_bits=state.intra_bits,
        gather_bits=state.gather_bits, group_size=state.group_size, topology=state.topology,
        error_feedback=state.feedback, feedback_key=key, stats=state.stats, kind=state.kind,
        stochastic=state.stochastic, seed=state.seed,
    )
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut
