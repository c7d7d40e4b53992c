"""zeropp: a ZeRO++ communication research toolkit.

Floors (each imports only downward): ``zeropp.kernels`` (block quantization), ``zeropp.comm``
(topology-aware, byte-accounted collectives: qwZ, qgZ, hpZ groups), ``zeropp.models`` (a small
byte-level GPT), ``zeropp.runtime`` (``ZeroEngine``: ZeRO stages 0-3 with the ZeRO++ switches).
Subpackages are imported on demand so ``import zeropp`` stays cheap.
"""

from .interrupts import quiet_interrupts_while_importing

__version__ = "0.1.0"

__all__ = ["__version__"]

quiet_interrupts_while_importing(__name__)  # Ctrl-C / SIGTERM while `python -m zeropp.X` imports: one line
