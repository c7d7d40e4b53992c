"""FSDP2 plug-in: qwZ and qgZ as FSDP2's custom all-gather / reduce-scatter.

``fully_shard`` models accept custom collectives per FSDP module
(``set_custom_all_gather`` / ``set_custom_reduce_scatter``, torch >= 2.8). The contracts
FSDP2 relies on, and how they are kept here:

- all-gather: the input is a view into the output buffer; ``quantized_all_gather`` quantizes
  the input before anything is written to the output. FSDP2 gathers a flat concatenation of
  the module's shards in one dtype; a ``uint8`` gather (mixed-dtype or custom
  ``fsdp_pre_all_gather`` parameters) carries raw bytes and is never quantized.
- reduce-scatter: ``op`` is AVG, SUM or PREMUL_SUM(1/factor) (custom gradient divide factor).
  The quantized path implements all three itself (AVG divides by the whole group), and the
  plain path emulates PREMUL_SUM on gloo, which has none. FSDP2 always calls it synchronously.
- the returned handle subclasses ``dist.Work``, which FSDP2 tests for before calling ``wait()``.

Usage::

    for layer in model.layers: fully_shard(layer)
    fully_shard(model)
    apply_zeropp_comms(model, weight_bits=8, grad_bits=4, topology=Topology(2, 2))
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from .backend import QUANT_FLOAT_DTYPES, ReduceOpLike, check_bits_arg, resolve_intra_bits
from .collectives import quantized_all_gather, quantized_reduce_scatter
from .qgz import ErrorFeedback
from .stochastic import check_base_seed
from .stats import CommStats
from .topology import Topology


class _Alloc:
    """Plain ``torch.empty`` buffers (FSDP2 frees them when the module reshards)."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)


class QuantizedAllGather(_Alloc, AllGather):
    """qwZ for FSDP2: each rank's flat shard quantized to ``bits`` (None = plain, accounted);
    ``stochastic=True`` rounds stochastically (seed rule: ``quantized_all_gather``)."""

    def __init__(
        self,
        bits: Optional[int] = 8,
        group_size: Optional[int] = None,
        *,
        topology: Optional[Topology] = None,
        stats: Optional[CommStats] = None,
        kind: str = "fsdp_all_gather",
        stochastic: bool = False,
        seed: Optional[int] = None,
    ) -> None:
        check_bits_arg(bits)
        self.bits, self.group_size, self.topology, self.stats, self.kind = bits, group_size, topology, stats, kind
        self.stochastic, self.seed = bool(stochastic), check_base_seed(seed)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> Optional[dist.Work]:
        bits = self.bits if input_tensor.dtype in QUANT_FLOAT_DTYPES else None  # raw bytes: never quantize
        return quantized_all_gather(
            output_tensor, input_tensor, group, bits=bits, group_size=self.group_size,
            topology=self.topology, stats=self.stats, kind=self.kind, async_op=async_op,
            stochastic=self.stochastic, seed=self.seed,
        )


class QuantizedReduceScatter(_Alloc, ReduceScatter):
    """qgZ for FSDP2: hierarchical when the group is the topology's whole multi-node world.

    ``error_feedback=True`` keeps this module's residual (one instance per FSDP module, which
    :func:`apply_zeropp_comms` ensures; the bucket is keyed by its size so a changed layout
    starts a fresh residual instead of failing). ``stochastic=True`` rounds stochastically (seed
    rule: ``quantized_reduce_scatter``)."""

    def __init__(
        self,
        bits: Optional[int] = 4,
        intra_bits: Optional[int] = None,
        group_size: Optional[int] = None,
        *,
        topology: Optional[Topology] = None,
        stats: Optional[CommStats] = None,
        error_feedback: bool = False,
        kind: str = "fsdp_reduce_scatter",
        stochastic: bool = False,
        seed: Optional[int] = None,
    ) -> None:
        resolve_intra_bits(bits, intra_bits)  # fail here, not in the first backward
        self.stochastic, self.seed = bool(stochastic), check_base_seed(seed)
        self.bits, self.intra_bits, self.group_size = bits, intra_bits, group_size
        self.topology, self.stats, self.kind = topology, stats, kind
        self.error_feedback = ErrorFeedback() if error_feedback else None

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: ReduceOpLike,
        async_op: bool = False,
    ) -> Optional[dist.Work]:
        return quantized_reduce_scatter(
            output_tensor, input_tensor, op, group, bits=self.bits, intra_bits=self.intra_bits,
            group_size=self.group_size, topology=self.topology, error_feedback=self.error_feedback,
            feedback_key=f"numel{input_tensor.numel()}", stats=self.stats, kind=self.kind, async_op=async_op,
            stochastic=self.stochastic, seed=self.seed,
        )


def apply_zeropp_comms(
    model: torch.nn.Module,
    *,
    weight_bits: Optional[int] = 8,
    grad_bits: Optional[int] = 4,
    intra_grad_bits: Optional[int] = None,
    weight_group_size: Optional[int] = None,
    grad_group_size: Optional[int] = None,
    topology: Optional[Topology] = None,
    stats: Optional[CommStats] = None,
    error_feedback: bool = False,
    weight_stochastic: bool = False,
    grad_stochastic: bool = False,
    seed: Optional[int] = None,
) -> int:
    """Install qwZ / qgZ on every FSDP module of ``model`` (after ``fully_shard``); returns how
    many modules were set. ``None`` bits keep the plain collective (still byte-accounted).
    ``weight_stochastic`` / ``grad_stochastic``: stochastic rounding of the weight gathers /
    gradient reduce-scatters, base ``seed`` (see ``quantized_all_gather`` for the seed rule)."""
    check_base_seed(seed)
    count = 0
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_all_gather(
                QuantizedAllGather(weight_bits, weight_group_size, topology=topology, stats=stats,
                                   stochastic=weight_stochastic, seed=seed)
            )
            m.set_custom_reduce_scatter(
                QuantizedReduceScatter(
                    grad_bits, intra_grad_bits, grad_group_size, topology=topology, stats=stats,
                    error_feedback=error_feedback, stochastic=grad_stochastic, seed=seed,
                )
            )
            count += 1
    if count == 0:
        raise ValueError("apply_zeropp_comms found no FSDP module in the model; call fully_shard(...) first")
    return count
