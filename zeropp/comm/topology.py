"""Where each rank sits: ``world_size = nodes x ranks_per_node`` and the process groups ZeRO++ uses.

Ranks are numbered node-major: ``rank = node * ranks_per_node + local``. On one machine the node
size is only a setting, so 4 processes can pose as 2 nodes of 2 or 1 node of 4; the collectives
then route and account their traffic as if the nodes were real.

Three families of groups (each rank belongs to one group of each):

- intra: the ``ranks_per_node`` ranks of one node (qgZ's first hop, hpZ's default group);
- cross: the ``nodes`` ranks with the same local index, one per node (qgZ's second hop);
- hpz:   ``hpz_size`` consecutive ranks inside a node (hpZ secondary partition; default the
  whole node, a smaller divisor gives MiCS-like sub-node groups).

``dist.new_group`` is collective over the default group: every rank must create every group,
in the same order, even the groups it is not part of. :meth:`Topology.build` does exactly that
once per (topology, world) and caches the result, so calling it again (or letting a collective
call it) is free and safe.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class Topology:
    """A world of ``nodes`` nodes with ``ranks_per_node`` ranks each (see the module docstring)."""

    nodes: int
    """Number of (real or emulated) nodes; any positive count, odd ones included."""
    ranks_per_node: int
    """Ranks on each node; ranks ``n*ranks_per_node ... (n+1)*ranks_per_node - 1`` form node ``n``."""
    hpz_size: Optional[int] = None
    """Size of the hpZ secondary-partition group: ``None`` = the whole node; otherwise a divisor of
    ``ranks_per_node`` (consecutive ranks inside a node), so hpZ never crosses a node boundary."""

    def __post_init__(self) -> None:
        for name in ("nodes", "ranks_per_node"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"Topology.{name} must be a positive int, got {v!r}")
        h = self.hpz_size
        if h is not None:
            if not isinstance(h, int) or isinstance(h, bool) or h <= 0 or self.ranks_per_node % h:
                raise ValueError(
                    f"Topology.hpz_size={h!r} must be a positive divisor of ranks_per_node="
                    f"{self.ranks_per_node} (or None for the whole node)"
                )

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_world(cls, world_size: int, ranks_per_node: int, hpz_size: Optional[int] = None) -> "Topology":
        """``world_size`` ranks in nodes of ``ranks_per_node``; a world that does not divide is an error."""
        if not isinstance(world_size, int) or world_size <= 0:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if not isinstance(ranks_per_node, int) or ranks_per_node <= 0:
            raise ValueError(f"ranks_per_node must be a positive int, got {ranks_per_node!r}")
        if world_size % ranks_per_node:
            raise ValueError(
                f"world_size={world_size} is not a multiple of ranks_per_node={ranks_per_node}; "
                f"choose a ranks_per_node that divides the world (e.g. one of "
                f"{[d for d in range(1, world_size + 1) if world_size % d == 0]})"
            )
        return cls(world_size // ranks_per_node, ranks_per_node, hpz_size)

    @classmethod
    def single_node(cls, world_size: int) -> "Topology":
        """Everything on one node: the default when no topology was given."""
        return cls(1, world_size)

    # ------------------------------------------------------------------ rank arithmetic
    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def hpz_group_size(self) -> int:
        return self.ranks_per_node if self.hpz_size is None else self.hpz_size

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside this topology's world of {self.world_size} ({self})")

    def node_of(self, rank: int) -> int:
        self._check_rank(rank)
        return rank // self.ranks_per_node

    def local_rank(self, rank: int) -> int:
        self._check_rank(rank)
        return rank % self.ranks_per_node

    def same_node(self, a: int, b: int) -> bool:
        return self.node_of(a) == self.node_of(b)

    def intra_ranks(self, rank: int) -> list[int]:
        """Global ranks of ``rank``'s node, in local order."""
        n = self.node_of(rank)
        return list(range(n * self.ranks_per_node, (n + 1) * self.ranks_per_node))

    def cross_ranks(self, rank: int) -> list[int]:
        """Global ranks with ``rank``'s local index, one per node, in node order."""
        loc = self.local_rank(rank)
        return [m * self.ranks_per_node + loc for m in range(self.nodes)]

    def hpz_ranks(self, rank: int) -> list[int]:
        """Global ranks of ``rank``'s hpZ group (consecutive, inside its node)."""
        self._check_rank(rank)
        h = self.hpz_group_size
        start = rank // h * h
        return list(range(start, start + h))

    def check_world(self, world_size: int) -> None:
        """Raise if this topology does not describe a world of ``world_size`` ranks."""
        if world_size != self.world_size:
            raise ValueError(
                f"{self} describes {self.world_size} ranks but the process group has {world_size}; "
                f"use Topology.from_world({world_size}, ranks_per_node=...)"
            )

    # ------------------------------------------------------------------ process groups
    def build(self) -> "TopologyGroups":
        """Create (once per world; cached) this rank's intra, cross and hpZ groups.

        Collective over the default group the first time: every rank must call it. Raises on
        every rank alike if the default group's size does not match.
        """
        if not dist.is_initialized():
            raise RuntimeError("Topology.build() needs torch.distributed to be initialised first")
        world = dist.group.WORLD
        cached = _GROUPS.get(self)
        if cached is not None and cached.world is world:
            return cached
        self.check_world(dist.get_world_size())
        rank = dist.get_rank()
        W, rpn = self.world_size, self.ranks_per_node

        def make(ranks: list[int]) -> dist.ProcessGroup:
            # A group of the full world is the world itself: no extra communicator.
            return world if len(ranks) == W else dist.new_group(ranks)

        intra = cross = hpz = None
        for n in range(self.nodes):  # same order on every rank
            g = make(list(range(n * rpn, (n + 1) * rpn)))
            if n == self.node_of(rank):
                intra = g
        for loc in range(rpn):
            g = make([m * rpn + loc for m in range(self.nodes)])
            if loc == self.local_rank(rank):
                cross = g
        h = self.hpz_group_size
        if h == rpn:
            hpz = intra
        else:
            for start in range(0, W, h):
                g = make(list(range(start, start + h)))
                if start <= rank < start + h:
                    hpz = g
        groups = TopologyGroups(self, world, intra, cross, hpz)
        _GROUPS[self] = groups
        return groups


@dataclasses.dataclass(frozen=True)
class TopologyGroups:
    """The process groups of one rank under a :class:`Topology` (from :meth:`Topology.build`)."""

    topology: Topology
    world: dist.ProcessGroup
    """The default group these groups were built in (the cache checks it is still current)."""
    intra: dist.ProcessGroup
    """This rank's node (group rank = local index)."""
    cross: dist.ProcessGroup
    """The ranks with this rank's local index, one per node (group rank = node index)."""
    hpz: dist.ProcessGroup
    """This rank's hpZ secondary-partition group (group rank = index inside it)."""


_GROUPS: dict[Topology, TopologyGroups] = {}
_DEFAULT: Optional[Topology] = None


def set_topology(topology: Optional[Topology]) -> None:
    """Make ``topology`` the process-wide default used by collectives called without one."""
    global _DEFAULT
    if topology is not None and not isinstance(topology, Topology):
        raise TypeError(f"set_topology expects a Topology or None, got {type(topology).__name__}")
    _DEFAULT = topology


def get_topology() -> Optional[Topology]:
    """The process-wide default topology (``None`` = all ranks on one node)."""
    return _DEFAULT


def resolve_topology(topology: Optional[Topology]) -> Topology:
    """``topology``, else the default, else one node holding the whole world; checked against the
    default group's size (the same check on every rank, so a mismatch raises everywhere)."""
    topo = topology if topology is not None else _DEFAULT
    world = dist.get_world_size()
    if topo is None:
        return Topology.single_node(world)
    if not isinstance(topo, Topology):
        raise TypeError(f"topology must be a zeropp.comm.Topology, got {type(topo).__name__}")
    topo.check_world(world)
    return topo
