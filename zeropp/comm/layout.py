"""How a launcher placed the ranks on hosts, read from its environment: :class:`LaunchLayout`.

Where the nodes are real (torchrun across hosts), the launcher knows the layout, and a
:class:`~zeropp.comm.topology.Topology` must agree with it: one that puts peers of different hosts
on one "node" would route and account their traffic as intra-node. :meth:`LaunchLayout.from_env`
reads torchrun's variables (``LOCAL_WORLD_SIZE``, ``GROUP_WORLD_SIZE``, ``GROUP_RANK`` /
``NODE_RANK``, ``LOCAL_RANK``), checks them against each other, and refuses what a topology of
equal, host-by-host numbered nodes cannot describe; :meth:`LaunchLayout.topology` derives the
topology and :meth:`LaunchLayout.check` checks a given one. The runner uses both under torchrun
(``zeropp.experiments.runner.run``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Optional

from .topology import Topology

__all__ = ["LaunchLayout"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchLayout:
    """How a launcher placed the ranks on hosts, as its environment says (:meth:`from_env`).

    Hand-written rather than taken from torch: torch's elastic agent sets these variables but
    offers no reader that checks them against each other.
    """

    nodes: int
    """Hosts (torchrun agents): ``GROUP_WORLD_SIZE``, or ``WORLD_SIZE / LOCAL_WORLD_SIZE``."""
    ranks_per_node: int
    """Ranks on each host: ``LOCAL_WORLD_SIZE`` (the same on every host)."""
    node: int
    """This process's host: ``GROUP_RANK`` (torchrun), else ``NODE_RANK``, else ``rank // ranks_per_node``."""
    local_rank: int
    """This process's index on its host: ``LOCAL_RANK``."""
    rank: int
    """This process's global rank: ``RANK``."""
    launcher: str = "torchrun"
    """The launcher's name, for messages."""

    def __post_init__(self) -> None:
        for name in ("nodes", "ranks_per_node"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"LaunchLayout.{name} must be a positive int, got {v!r}")
        for name, bound in (("node", self.nodes), ("local_rank", self.ranks_per_node), ("rank", self.world_size)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < bound:
                raise ValueError(
                    f"LaunchLayout.{name}={v!r} must be an int in [0, {bound}) for a launch of {self.describe()}"
                )

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def describe(self) -> str:
        """``2 nodes x 2 local ranks``."""
        return (
            f"{self.nodes} node{'s' if self.nodes != 1 else ''} x {self.ranks_per_node} local "
            f"rank{'s' if self.ranks_per_node != 1 else ''}"
        )

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None, launcher: str = "torchrun") -> Optional[LaunchLayout]:
        """The layout ``env`` (default ``os.environ``) describes, or ``None`` when it names none
        (neither ``LOCAL_WORLD_SIZE`` nor ``GROUP_WORLD_SIZE`` is set).

        Raises ``ValueError`` when the variables contradict each other or describe what a
        :class:`Topology` cannot: hosts running different numbers of ranks, or global ranks not
        numbered host by host (rank = node x ranks_per_node + local rank, as torchrun assigns them).
        """
        env = os.environ if env is None else env
        if "LOCAL_WORLD_SIZE" not in env and "GROUP_WORLD_SIZE" not in env:
            return None

        def read(name: str, minimum: int) -> Optional[int]:
            raw = env.get(name)
            if raw is None:
                return None
            try:
                v = int(raw)
            except ValueError:
                v = None
            if v is None or v < minimum:
                raise ValueError(f"{launcher} environment: {name}={raw!r} is not an integer >= {minimum}")
            return v

        world, rank, local_rank = read("WORLD_SIZE", 1), read("RANK", 0), read("LOCAL_RANK", 0)
        for name, v in (("WORLD_SIZE", world), ("RANK", rank), ("LOCAL_RANK", local_rank)):
            if v is None:
                raise ValueError(
                    f"{launcher} environment: {name} is not set (a launcher that sets "
                    "LOCAL_WORLD_SIZE / GROUP_WORLD_SIZE must set RANK, WORLD_SIZE and LOCAL_RANK)"
                )
        assert world is not None and rank is not None and local_rank is not None
        local_world, groups = read("LOCAL_WORLD_SIZE", 1), read("GROUP_WORLD_SIZE", 1)
        for name, v in (("LOCAL_WORLD_SIZE", local_world), ("GROUP_WORLD_SIZE", groups)):
            if v is not None and v > world:
                raise ValueError(
                    f"{launcher} environment: {name}={v} is more than WORLD_SIZE={world} (the ranks of "
                    "the whole job): the variables contradict each other; start the job with its "
                    "launcher's own tools (torchrun --nnodes / --nproc-per-node)"
                )
        if local_world is None:
            assert groups is not None
            local_world = world // groups
        if groups is None:
            groups = world // local_world
        if groups * local_world != world:
            raise ValueError(
                f"{launcher} started {world} ranks on {groups} node(s) with LOCAL_WORLD_SIZE={local_world} here: "
                "the nodes run different numbers of ranks, which a topology of equal nodes cannot describe; "
                f"start the same number of ranks on every node (torchrun --nproc-per-node)"
            )
        node = read("GROUP_RANK", 0)
        if node is None:
            node = read("NODE_RANK", 0)
        if node is None:
            node = rank // local_world
        layout = cls(
            nodes=groups, ranks_per_node=local_world, node=node, local_rank=local_rank, rank=rank, launcher=launcher
        )
        expected = node * local_world + local_rank
        if rank != expected:
            raise ValueError(
                f"{launcher} placed rank {rank} on node {node} as local rank {local_rank}, but a topology numbers "
                f"ranks node by node (rank = node x {local_world} + local rank = {expected}), so its node groups "
                "would span hosts; start the ranks host by host with contiguous ranks (torchrun does)"
            )
        return layout

    def topology(self, hpz_size: Optional[int] = None, tp: int = 1) -> Topology:
        """The :class:`Topology` of this launch (``hpz_size`` / ``tp`` as in :class:`Topology`)."""
        return Topology(self.nodes, self.ranks_per_node, hpz_size, tp)

    def check(self, topology: Topology) -> None:
        """Raise ``ValueError`` unless ``topology`` has this launch's nodes and ranks per node."""
        if (topology.nodes, topology.ranks_per_node) != (self.nodes, self.ranks_per_node):
            rn, rr = topology.nodes, topology.ranks_per_node
            raise ValueError(
                f"topology says {rn} node{'s' if rn != 1 else ''} x {rr} rank{'s' if rr != 1 else ''} "
                f"but {self.launcher} started {self.describe()}"
            )
