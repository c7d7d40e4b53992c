"""Stand-ins for the components that report memory to ``zeropp.runtime.memory.account``: one
with fixed bytes per tier (as the activation tracker does) and one with ``nbytes`` only (as the
communication buffer pool does)."""

from __future__ import annotations


class FakeComponent:
    """A component reporting fixed bytes, as the activation tracker / buffer pool will."""

    def __init__(self, tiers: dict[str, int]) -> None:
        self.tiers = tiers

    def memory_by_tier(self) -> dict[str, int]:
        return dict(self.tiers)


class FakePool:
    """A component with ``nbytes`` only (the communication buffer pool): device bytes."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
