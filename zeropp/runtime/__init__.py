"""zeropp.runtime: the ZeRO stage 0-3 engine with the ZeRO++ switches (qwZ, hpZ, qgZ).

The checkpoint code (``torch.distributed.checkpoint``, which imports DTensor and sympy: seconds of
start-up per process) is imported when a checkpoint is saved, loaded or consolidated, not here.
"""

from typing import TYPE_CHECKING, Any

from .batch import MicroBatchError, WithTargets
from .blocks import BlockChoiceWarning
from .checkpoint_files import CheckpointError
from .choices import MemoryTier, OffloadTier, Precision, QuantizeFrozen, Schedule
from .config import OptimizerConfig, ZeroConfig
from .engine import StepResult, ZeroEngine
from .loss_scale import DynamicLossScaler, LossScaler, StaticLossScaler
from .memory import expected_memory, hpz_bytes_per_param, measure_memory
from .optimizer import ShardedAdamW
from .partition import UnitLayout
from .streams import CommStreams

if TYPE_CHECKING:
    from .consolidate import export_consolidated, read_consolidated

__all__ = [
    "BlockChoiceWarning",
    "CheckpointError",
    "CommStreams",
    "DynamicLossScaler",
    "LossScaler",
    "MemoryTier",
    "MicroBatchError",
    "OffloadTier",
    "OptimizerConfig",
    "Precision",
    "QuantizeFrozen",
    "Schedule",
    "ShardedAdamW",
    "StaticLossScaler",
    "StepResult",
    "UnitLayout",
    "WithTargets",
    "ZeroConfig",
    "ZeroEngine",
    "expected_memory",
    "export_consolidated",
    "hpz_bytes_per_param",
    "measure_memory",
    "read_consolidated",
]


_LAZY = {"export_consolidated": ".consolidate", "read_consolidated": ".consolidate"}
"""Exported names whose modules are imported on first use (see the module docstring)."""


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
