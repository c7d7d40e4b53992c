"""Where a world's ranks run and what each rank is told: placements, module entries, devices.

:class:`Placement` (:data:`LOCAL`: every rank on this host; the emulated cluster's is built in
``runner/launcher.py``), :class:`ModuleEntry` (a rank that runs ``python -m <module>``),
:func:`select_device` (a rank's device and process-group backend), :func:`in_torchrun`,
:func:`free_port`, :data:`LAUNCHED_MARK` and :class:`PlacementError`. ``world.py`` starts the
ranks; these are the values it is given.
"""

from __future__ import annotations

import dataclasses
import os
import socket

import torch

from zeropp.interrupts import LAUNCHED_MARK

from .failure import RankFailure

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# LAUNCHED_MARK (from zeropp.interrupts, which also reads it): set in ranks this launcher starts, so a
# rank never mistakes itself for a torchrun rank that should spawn


class PlacementError(RankFailure):
    """The placement cannot run this job (no namespaces, CUDA on the emulated cluster); no rank started."""

    def __init__(self, message: str) -> None:
        super().__init__(message, exit_code=2)


def in_torchrun() -> bool:
    """True when torchrun (or any launcher with its env contract) started this process."""
    return all(v in os.environ for v in TORCHRUN_VARS) and LAUNCHED_MARK not in os.environ


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the rendezvous port of a world)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def select_device(want: str, local_rank: int, local_world_size: int) -> tuple[torch.device, str]:
    """This rank's device and process-group backend: ``(cuda:<local_rank>, "nccl")`` or ``(cpu, "gloo")``.

    ``want`` is ``launcher.device``: ``cpu``; ``cuda`` (an error unless this host has a GPU per
    local process); ``auto`` (CUDA exactly when it has). Choosing CUDA also sets this process's
    current device, so every later ``torch.cuda`` call and NCCL use ``cuda:<local_rank>``.
    """
    if want not in ("auto", "cpu", "cuda"):
        raise ValueError(f"launcher.device={want!r} is not one of auto, cpu, cuda")
    if not 0 <= local_rank < local_world_size:
        raise ValueError(f"LOCAL_RANK={local_rank} outside LOCAL_WORLD_SIZE={local_world_size}")
    gpus = torch.cuda.device_count() if want != "cpu" else 0
    if want == "cuda" and gpus < local_world_size:
        raise RuntimeError(
            f"launcher.device=cuda needs one GPU per process on this host: {local_world_size} "
            f"local process(es) but torch.cuda.device_count()={gpus}; use launcher.device=cpu "
            f"(or auto), or start at most {gpus} process(es) per host"
        )
    if want == "cpu" or gpus < local_world_size:
        return torch.device("cpu"), "gloo"
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank), "nccl"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Placement:
    """Where the ranks of one world run on this host, and how they find rank 0."""

    master_addr: str
    """Address rank 0 listens on, reachable from every rank."""
    prefixes: tuple[tuple[str, ...], ...] = ()
    """Per rank, argv prepended to a module rank's command (``ip netns exec <ns>``); empty = none."""
    envs: tuple[dict[str, str], ...] = ()
    """Per rank, extra environment (e.g. GLOO_SOCKET_IFNAME inside a namespace); empty = none."""
    info: dict = dataclasses.field(default_factory=dict)
    """What a run's summary records about the placement (cluster kind, emulated links, measured rate)."""

    def __post_init__(self) -> None:
        if not self.master_addr:
            raise ValueError("Placement.master_addr must be an address, got ''")
        if self.prefixes and self.envs and len(self.prefixes) != len(self.envs):
            raise ValueError(f"Placement has {len(self.prefixes)} prefixes but {len(self.envs)} envs")

    def check(self, world_size: int, *, function: bool) -> None:
        """Raise :class:`PlacementError` if this placement cannot hold ``world_size`` ranks of that kind."""
        for name, per_rank in (("prefixes", self.prefixes), ("envs", self.envs)):
            if per_rank and len(per_rank) != world_size:
                raise PlacementError(f"placement has {name} for {len(per_rank)} ranks, world_size={world_size}")
        if function and any(self.prefixes):
            raise PlacementError(
                "a function world cannot run behind a command prefix (e.g. emulated "
                "namespaces); start a module entrypoint (ModuleEntry) instead"
            )


LOCAL = Placement(master_addr="127.0.0.1", info={"cluster": "local"})
"""Every rank on this host, rendezvous on loopback."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModuleEntry:
    """A rank that runs ``python -m <module> <args...>`` (the same argv on every rank)."""

    module: str
    """Dotted module name, e.g. ``zeropp.experiments.runner.worker``."""
    args: tuple[str, ...] = ()
    """Command-line arguments after the module name."""
