"""zeropp.runtime: the ZeRO stage 0-3 engine with the ZeRO++ switches (qwZ, hpZ, qgZ)."""

from .checkpoint import CheckpointError
from .config import OptimizerConfig, ZeroConfig
from .engine import StepResult, ZeroEngine
from .memory import expected_memory, measure_memory
from .optimizer import ShardedAdamW

__all__ = ["CheckpointError", "OptimizerConfig", "ShardedAdamW", "StepResult", "ZeroConfig", "ZeroEngine", "expected_memory", "measure_memory"]
