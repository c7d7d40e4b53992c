"""zeropp.runtime: the ZeRO stage 0-3 engine with the ZeRO++ switches (qwZ, hpZ, qgZ)."""

from .batch import MicroBatchError, WithTargets
from .checkpoint import CheckpointError
from .choices import MemoryTier, OffloadTier, Precision, QuantizeFrozen, Schedule
from .config import OptimizerConfig, ZeroConfig
from .consolidate import export_consolidated, read_consolidated
from .engine import StepResult, ZeroEngine
from .loss_scale import DynamicLossScaler, LossScaler, StaticLossScaler
from .memory import expected_memory, hpz_bytes_per_param, measure_memory
from .optimizer import ShardedAdamW
from .partition import BlockChoiceWarning, UnitLayout
from .streams import CommStreams

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
