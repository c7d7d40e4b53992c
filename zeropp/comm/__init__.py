"""zeropp.comm: topology-aware, byte-accounted collectives for ZeRO++ (qwZ, qgZ, hpZ groups).

Floor 2 of the design (docs/design.md): built on ``zeropp.kernels``; used by ``zeropp.runtime``
and, through the plug-ins in ``zeropp.comm.fsdp`` / ``zeropp.comm.ddp``, by stock FSDP2 and DDP.
"""

from torch.distributed import ReduceOp

from .backend import CommHandle
from .choices import Rotation, Rounding, StrChoice
from .codecs import Codec, IntCodec, codec_for, register_codec, unregister_codec
from .collectives import all_reduce, quantized_all_gather, quantized_all_reduce, quantized_reduce_scatter
from .feedback import ErrorFeedback
from .layout import LaunchLayout
from .session import CommSession, default_session
from .spec import RECIPES, QuantRecipe, QuantSpec, register_scheme, schemes
from .stats import CommStats, get_comm_stats
from .stochastic import reset_stochastic_calls, stochastic_calls, stochastic_seed
from .topology import Topology, TopologyGroups, get_topology, set_topology

__all__ = [
    "RECIPES",
    "Codec",
    "CommHandle",
    "CommSession",
    "CommStats",
    "ErrorFeedback",
    "IntCodec",
    "LaunchLayout",
    "QuantRecipe",
    "QuantSpec",
    "ReduceOp",
    "Rotation",
    "Rounding",
    "StrChoice",
    "Topology",
    "TopologyGroups",
    "all_reduce",
    "codec_for",
    "default_session",
    "get_comm_stats",
    "get_topology",
    "quantized_all_gather",
    "quantized_all_reduce",
    "quantized_reduce_scatter",
    "register_codec",
    "register_scheme",
    "reset_stochastic_calls",
    "schemes",
    "set_topology",
    "stochastic_calls",
    "stochastic_seed",
    "unregister_codec",
]
