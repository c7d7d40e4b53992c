"""zeropp.comm: topology-aware, byte-accounted collectives for ZeRO++ (qwZ, qgZ, hpZ groups).

Floor 2 of the design (docs/design.md): built on ``zeropp.kernels``; used by ``zeropp.runtime``
and, through the plug-ins in ``zeropp.comm.fsdp`` / ``zeropp.comm.ddp``, by stock FSDP2 and DDP.
"""

from torch.distributed import ReduceOp

from .backend import CommHandle
from .collectives import all_reduce, quantized_all_gather, quantized_all_reduce, quantized_reduce_scatter
from .qgz import ErrorFeedback
from .stats import CommStats, get_comm_stats
from .stochastic import reset_stochastic_calls, stochastic_calls, stochastic_seed
from .topology import Topology, TopologyGroups, get_topology, set_topology

__all__ = [
    "CommHandle",
    "CommStats",
    "ErrorFeedback",
    "ReduceOp",
    "Topology",
    "TopologyGroups",
    "all_reduce",
    "get_comm_stats",
    "get_topology",
    "quantized_all_gather",
    "quantized_all_reduce",
    "quantized_reduce_scatter",
    "reset_stochastic_calls",
    "set_topology",
    "stochastic_calls",
    "stochastic_seed",
]
