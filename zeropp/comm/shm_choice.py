"""The record of what carries a group's plain collectives: :class:`TransportChoice`.

Kept apart from ``shm_auto.py`` (which decides it) so that a :class:`~.session.CommSession` can
hold one without importing the transport itself.
"""

from __future__ import annotations

import dataclasses

__all__ = ["TransportChoice"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransportChoice:
    """What carries a group's plain collectives, as requested and as resolved (the same on every
    member of the group)."""

    requested: str
    """The setting as given: ``auto``, ``shm`` or ``backend``."""
    resolved: str
    """What is used: ``shm`` or ``backend``."""
    reason: str
    """Why ``auto`` resolved so ("" for an explicit choice)."""

    def __post_init__(self) -> None:
        if self.requested not in ("auto", "backend", "shm") or self.resolved not in ("backend", "shm"):
            raise ValueError(
                f"TransportChoice: requested must be auto, backend or shm and resolved backend or shm; got "
                f"{self.requested!r} -> {self.resolved!r}"
            )

    def __str__(self) -> str:
        head = f"transport={self.requested}" + (f" -> {self.resolved}" if self.requested != self.resolved else "")
        return head + (f" ({self.reason})" if self.reason else "")

    def as_dict(self) -> dict[str, str]:
        """Plain values for a run's records (``summary.json``)."""
        return dataclasses.asdict(self)
