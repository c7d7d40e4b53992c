"""The runtime's fixed-choice settings, declared once (``str`` enums: ``zeropp.comm.choices`` says why).

``ZeroConfig`` and ``OptimizerConfig`` type their fields with these, the offload and memory code
reads the tier names from here, and the runner's Hydra schema validates them while composing.
"""

from __future__ import annotations

from zeropp.comm.choices import StrChoice

__all__ = ["DEFAULT_TRANSPORT", "MemoryTier", "OffloadTier", "Precision", "QuantizeFrozen", "Schedule", "Transport"]


class Precision(StrChoice):
    """``ZeroConfig.precision``: the compute and communication dtype."""

    fp32 = "fp32"
    """float32 (exactness checks)."""
    bf16 = "bf16"
    """bfloat16."""
    fp16 = "fp16"
    """float16, with dynamic loss scaling."""


class MemoryTier(StrChoice):
    """Where bytes live (``memory_by_tier()`` keys)."""

    device = "device"
    """The model's device."""
    host = "host"
    """Host (CPU) memory, pinned where it is staged for the device."""
    disk = "disk"
    """Swap files on disk (the ``nvme`` offload tier)."""


class OffloadTier(StrChoice):
    """``ZeroConfig.offload_optimizer`` / ``offload_param``: where offloaded state lives."""

    none = "none"
    """Not offloaded: on the model's device."""
    cpu = "cpu"
    """Pinned host memory."""
    nvme = "nvme"
    """Files under ``ZeroConfig.nvme_path``."""

    @property
    def memory_tier(self) -> MemoryTier:
        """The memory tier this offload setting puts its state on."""
        return _MEMORY_TIER[self]


_MEMORY_TIER = {
    OffloadTier.none: MemoryTier.device,
    OffloadTier.cpu: MemoryTier.host,
    OffloadTier.nvme: MemoryTier.disk,
}


class QuantizeFrozen(StrChoice):
    """``ZeroConfig.quantize_frozen``: MixZ++'s storage of frozen stage-3 shards."""

    none = "none"
    """The compute dtype."""
    int8 = "int8"
    """INT8 codes and scales, quantized once."""
    int4 = "int4"
    """INT4 codes and scales, quantized once."""


class Transport(StrChoice):
    """``ZeroConfig.transport``: how the ZeRO group's plain (unquantized) collectives move data."""

    auto = "auto"
    """``shm`` where every rank of the ZeRO group can use it (CPU ranks of one node, room under
    ``/dev/shm``), ``backend`` otherwise: decided once at set-up, the same on every rank."""
    backend = "backend"
    """The process group's backend (gloo, NCCL)."""
    shm = "shm"
    """Shared memory of the host (CPU ranks of one node; ``zeropp.comm.shm``)."""


DEFAULT_TRANSPORT = Transport.auto
"""The one default of ``ZeroConfig.transport`` and of an engine's communication built without one."""


class Schedule(StrChoice):
    """``OptimizerConfig.schedule``: the learning-rate schedule after warmup."""

    constant = "constant"
    cosine = "cosine"
