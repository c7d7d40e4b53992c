"""Where each rank sits: ``world_size = nodes x ranks_per_node`` and the process groups ZeRO++ uses.

Ranks are numbered node-major: ``rank = node * ranks_per_node + local``. On one machine the node
size is only a setting, so 4 processes can pose as 2 nodes of 2 or 1 node of 4; the collectives
then route and account their traffic as if the nodes were real.

Three families of groups (each rank belongs to one group of each):

- intra: the ``ranks_per_node`` ranks of one node (qgZ's first hop, hpZ's default group);
- cross: the ``nodes`` ranks with the same local index, one per node (qgZ's second hop);
- hpz:   ``hpz_size`` consecutive ranks inside a node (hpZ secondary partition; default the
  whole node, a smaller divisor gives MiCS-like sub-node groups).

Tensor parallelism (``tp > 1``): every ``tp`` consecutive ranks of a node form one tensor-parallel
group (``rank = dp_index * tp + tp_index``, the row-major layout of a ``("dp", "tp")``
``DeviceMesh``). ZeRO then runs over the data-parallel dimension only, so every group above keeps
only the ranks with this rank's ``tp_index``: ``dp`` is all of them (ZeRO's "world"), intra the ones
on this node, hpz the ones inside this rank's ``hpz_size`` block, and cross is unchanged (the ranks
with this local index already share the tp index). Node membership and byte accounting stay in
global ranks, so intra- and cross-node traffic is classified as before.

``dist.new_group`` is collective over the default group: every rank must create every group,
in the same order, even the groups it is not part of. :meth:`Topology.build` does exactly that
once per (topology, world) and caches the result, so calling it again (or letting a collective
call it) is free and safe. The cache holds the groups weakly (torch's registry holds them until
``destroy_process_group``), so it never keeps a destroyed world's groups, and their backend
threads, alive.

Where the nodes are real (torchrun across hosts), the launcher knows the layout:
``zeropp.comm.layout.LaunchLayout`` reads it so that a topology can be derived from it, or checked
against it.
"""

from __future__ import annotations

import dataclasses
import weakref
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
    ``ranks_per_node`` (consecutive ranks inside a node), so hpZ never crosses a node boundary.
    With ``tp > 1`` it counts global ranks and must be a multiple of ``tp``; the group is the
    ``hpz_size / tp`` data-parallel peers inside that block."""
    tp: int = 1
    """Tensor-parallel degree: ``tp`` consecutive ranks inside a node split each block's heads and
    MLP (``zeropp.runtime.tensor_parallel``); ZeRO shards over the other ``world_size / tp``
    ranks. Must divide ``ranks_per_node`` (tensor parallelism never crosses a node). 1 = off."""

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
        t = self.tp
        if not isinstance(t, int) or isinstance(t, bool) or t <= 0 or self.ranks_per_node % t:
            raise ValueError(
                f"Topology.tp={t!r} must be a positive divisor of ranks_per_node={self.ranks_per_node} "
                f"(tensor parallelism stays inside a node); choose one of "
                f"{[d for d in range(1, self.ranks_per_node + 1) if self.ranks_per_node % d == 0]}"
            )
        if t > 1 and self.hpz_group_size % t:
            raise ValueError(
                f"Topology.hpz_size={h!r} must be a multiple of tp={t} (an hpZ group holds whole "
                f"tensor-parallel groups); choose a multiple of {t} that divides {self.ranks_per_node}"
            )

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_world(cls, world_size: int, ranks_per_node: int, hpz_size: Optional[int] = None, tp: int = 1) -> Topology:
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
        return cls(world_size // ranks_per_node, ranks_per_node, hpz_size, tp)

    @classmethod
    def single_node(cls, world_size: int) -> Topology:
        """Everything on one node: the default when no topology was given."""
        return cls(1, world_size)

    # ------------------------------------------------------------------ rank arithmetic
    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def hpz_group_size(self) -> int:
        return self.ranks_per_node if self.hpz_size is None else self.hpz_size

    @property
    def dp_size(self) -> int:
        """Ranks ZeRO shards over: ``world_size / tp``."""
        return self.world_size // self.tp

    def tp_index(self, rank: int) -> int:
        """``rank``'s position inside its tensor-parallel group (0 when ``tp == 1``)."""
        self._check_rank(rank)
        return rank % self.tp

    def dp_index(self, rank: int) -> int:
        """``rank``'s position among its data-parallel peers (= ``rank`` when ``tp == 1``)."""
        self._check_rank(rank)
        return rank // self.tp

    def dp_ranks(self, rank: int) -> list[int]:
        """Global ranks sharing ``rank``'s tp index, in data-parallel order (ZeRO's world)."""
        t = self.tp_index(rank)
        return list(range(t, self.world_size, self.tp))

    def tp_ranks(self, rank: int) -> list[int]:
        """Global ranks of ``rank``'s tensor-parallel group (consecutive, inside its node)."""
        start = self.dp_index(rank) * self.tp
        return list(range(start, start + self.tp))

    def _same_tp(self, rank: int, ranks: list[int]) -> list[int]:
        t = rank % self.tp
        return [r for r in ranks if r % self.tp == t]

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
        """Global ranks of ``rank``'s node, in local order (with ``tp > 1``: those sharing its tp index)."""
        n = self.node_of(rank)
        return self._same_tp(rank, list(range(n * self.ranks_per_node, (n + 1) * self.ranks_per_node)))

    def cross_ranks(self, rank: int) -> list[int]:
        """Global ranks with ``rank``'s local index, one per node, in node order."""
        loc = self.local_rank(rank)
        return [m * self.ranks_per_node + loc for m in range(self.nodes)]

    def hpz_ranks(self, rank: int) -> list[int]:
        """Global ranks of ``rank``'s hpZ group (consecutive, inside its node; with ``tp > 1``
        those of the block sharing its tp index)."""
        self._check_rank(rank)
        h = self.hpz_group_size
        start = rank // h * h
        return self._same_tp(rank, list(range(start, start + h)))

    def check_world(self, world_size: int) -> None:
        """Raise if this topology does not describe a world of ``world_size`` ranks."""
        if world_size != self.world_size:
            raise ValueError(
                f"{self} describes {self.world_size} ranks but the process group has {world_size}; "
                f"use Topology.from_world({world_size}, ranks_per_node=...)"
            )

    # ------------------------------------------------------------------ process groups
    def build(self) -> TopologyGroups:
        """Create (once per world; cached) this rank's intra, cross and hpZ groups.

        Collective over the default group the first time: every rank must call it. Raises on
        every rank alike if the default group's size does not match.
        """
        if not dist.is_initialized():
            raise RuntimeError("Topology.build() needs torch.distributed to be initialised first")
        world = dist.group.WORLD
        cached = _GROUPS.get(self)
        if cached is not None and cached.built_in(world):
            return cached
        self.check_world(dist.get_world_size())
        rank = dist.get_rank()
        W, rpn = self.world_size, self.ranks_per_node

        def make(ranks: list[int]) -> dist.ProcessGroup:
            # A group of the full world is the world itself: no extra communicator.
            return world if len(ranks) == W else dist.new_group(ranks)

        tp = self.tp
        intra = cross = hpz = dp = None
        for n in range(self.nodes):  # same order on every rank
            for t in range(tp):
                g = make([r for r in range(n * rpn, (n + 1) * rpn) if r % tp == t])
                if n == self.node_of(rank) and t == rank % tp:
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
                for t in range(tp):
                    g = make([r for r in range(start, start + h) if r % tp == t])
                    if start <= rank < start + h and t == rank % tp:
                        hpz = g
        if tp == 1:
            dp = world
        else:
            for t in range(tp):
                g = make(list(range(t, W, tp)))
                if t == rank % tp:
                    dp = g
        groups = TopologyGroups(self, world, intra, cross, hpz, dp)
        _GROUPS[self] = groups
        return groups


class TopologyGroups:
    """The process groups of one rank under a :class:`Topology` (from :meth:`Topology.build`).

    Holds its groups weakly: torch keeps them until ``destroy_process_group()``, and this object
    (which :meth:`Topology.build` caches) must not keep a destroyed group, with its backend
    threads, alive past it. Reading a group after it was destroyed raises; build again after a
    new ``init_process_group``."""

    _NAMES = ("world", "intra", "cross", "hpz", "dp")

    def __init__(
        self,
        topology: Topology,
        world: dist.ProcessGroup,
        intra: dist.ProcessGroup,
        cross: dist.ProcessGroup,
        hpz: dist.ProcessGroup,
        dp: dist.ProcessGroup,
    ) -> None:
        self.topology = topology
        self._refs = tuple(weakref.ref(g) for g in (world, intra, cross, hpz, dp))

    def _group(self, i: int) -> dist.ProcessGroup:
        g = self._refs[i]()
        if g is None:
            raise RuntimeError(
                f"the {self._NAMES[i]} group of {self.topology} was destroyed (destroy_process_group); "
                "after a new init_process_group, call topology.build() again"
            )
        return g

    def built_in(self, world: dist.ProcessGroup) -> bool:
        """Whether these groups were built in the default group ``world`` and all still exist."""
        return self._refs[0]() is world and all(r() is not None for r in self._refs)

    @property
    def world(self) -> dist.ProcessGroup:
        """The default group these groups were built in (the cache checks it is still current)."""
        return self._group(0)

    @property
    def intra(self) -> dist.ProcessGroup:
        """This rank's node (group rank = local index)."""
        return self._group(1)

    @property
    def cross(self) -> dist.ProcessGroup:
        """The ranks with this rank's local index, one per node (group rank = node index)."""
        return self._group(2)

    @property
    def hpz(self) -> dist.ProcessGroup:
        """This rank's hpZ secondary-partition group (group rank = index inside it)."""
        return self._group(3)

    @property
    def dp(self) -> dist.ProcessGroup:
        """ZeRO's world: the ranks sharing this rank's tp index (group rank = dp index); the
        default group itself when ``tp == 1``."""
        return self._group(4)


_GROUPS: dict[Topology, TopologyGroups] = {}
_DEFAULT: Optional[Topology] = None


def set_topology(topology: Optional[Topology]) -> None:
    """Make ``topology`` the process-wide default used by collectives called without one (and by
    sessions created without one, ``session.CommSession``). Checked against the default group's
    size when one is initialised: a topology of another world is refused here, where it is set,
    rather than by every later collective."""
    global _DEFAULT
    if topology is not None and not isinstance(topology, Topology):
        raise TypeError(f"set_topology expects a Topology or None, got {type(topology).__name__}")
    if topology is not None and dist.is_initialized():
        topology.check_world(dist.get_world_size())
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
