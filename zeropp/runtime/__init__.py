"""zeropp.runtime: the ZeRO stage 0-3 engine with the ZeRO++ switches (qwZ, hpZ, qgZ)."""

from .checkpoint import CheckpointError
from .consolidate import export_consolidated
from .config import OptimizerConfig, ZeroConfig
from .engine import StepResult, ZeroEngine
from .loss_scale import DynamicLossScaler, LossScaler, StaticLossScaler
from .memory import expected_memory, measure_memory
from .optimizer import ShardedAdamW
from .partition import UnitLayout
from .streams import CommStreams

__all__ = ["CheckpointError", "CommStreams", "DynamicLossScaler", "LossScaler", "OptimizerConfig", "ShardedAdamW", "StaticLossScaler",
           "StepResult", "UnitLayout", "ZeroConfig", "ZeroEngine", "expected_memory", "export_consolidated",
           "measure_memory"]
