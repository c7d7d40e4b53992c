"""Plug zeropp's collectives into stock PyTorch trainers (trainer=fsdp2_zeropp, ddp_zeropp).

The quantization switches come from the same ``zero.*`` keys as ZeroEngine's, so a sweep can
compare the engine and FSDP2/DDP with identical bit widths. Each returns the CommStats the
plug-in records into, which the runner reports as the trainer's semantic byte counts.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from .config import RunConfig


def install_fsdp_comms(model: nn.Module, cfg: RunConfig, topology: Any) -> Any:
    """qwZ (``zero.qwz_bits``) and qgZ (``zero.qgz_bits``) as FSDP2's custom collectives."""
    from zeropp.comm import CommStats
    from zeropp.comm.fsdp import apply_zeropp_comms

    z = cfg.zero
    stats = CommStats()
    apply_zeropp_comms(model, weight_bits=z.qwz_bits, grad_bits=z.qgz_bits, intra_grad_bits=z.qgz_intra_bits,
                       weight_group_size=z.qwz_group_size, grad_group_size=z.qgz_group_size,
                       topology=topology, stats=stats, error_feedback=z.qgz_error_feedback,
                       weight_stochastic=z.qwz_stochastic, grad_stochastic=z.qgz_stochastic)
    return stats


def install_ddp_hook(ddp: nn.Module, cfg: RunConfig, topology: Any) -> Any:
    """The quantized gradient all-reduce hook (bits ``zero.qgz_bits``) on a DDP model."""
    from zeropp.comm import CommStats
    from zeropp.comm.ddp import QuantizedAllReduceState, quantized_allreduce_hook

    z = cfg.zero
    stats = CommStats()
    state = QuantizedAllReduceState(bits=z.qgz_bits, intra_bits=z.qgz_intra_bits, group_size=z.qgz_group_size,
                                    topology=topology, stats=stats, error_feedback=z.qgz_error_feedback,
                                    stochastic=z.qgz_stochastic)
    ddp.register_comm_hook(state, quantized_allreduce_hook)  # type: ignore[operator]
    return stats
