"""The runner's side of launching: placements of the ranks and the runner's one call.

Ranks start through ``zeropp.experiments.launch.launch_world`` (torch's elastic multiprocessing, watched; see
there). Here: the emulated cluster's placement (each rank behind ``ip netns exec <node ns>``, with
its namespace's env), which device the ranks of a placement may use, and :func:`launch`, which
writes the run's spec and starts ``python -m <pkg>.worker <spec.json>`` on every rank.
"""

from __future__ import annotations

import contextlib
import json
import signal
from pathlib import Path
from typing import Iterator, Sequence

from ..cluster import ClusterInterrupted, EmulatedCluster, NetnsError
from ..launch import (
    LOCAL,
    ModuleEntry,
    Placement,
    PlacementError,
    RankFailure,
    RunInterrupted,
    in_torchrun,
    launch_world,
)


def worker_module(package: str | None) -> str:
    """``experiments.runner.worker`` when run from the repo root, ``zeropp.experiments.runner.worker`` otherwise."""
    return f"{package or 'zeropp.experiments.runner'}.worker"


def device_for_cluster(want: str, cluster: str) -> str:
    """The ``launcher.device`` to hand the ranks of a ``cluster`` (``local`` or ``emulated``) placement.

    The emulated cluster shapes only the sockets that cross its namespaces' links; NCCL between
    GPUs of one host goes over P2P/shared memory and would report a shaped link it never used.
    So ``cuda`` there is refused and ``auto`` means ``cpu``.
    """
    if cluster != "emulated":
        return want
    if want == "cuda":
        raise PlacementError(
            "cluster=emulated cannot run launcher.device=cuda: NCCL would carry the traffic over "
            "GPU peer-to-peer / shared memory and bypass the shaped links, so the measured link "
            "would be false. Use cluster=local for GPU runs, or launcher.device=cpu to emulate."
        )
    return "cpu"


def cluster_placement(cluster: EmulatedCluster) -> Placement:
    """The placement of an emulated cluster that is up: each rank in its node's namespace."""
    n = cluster.world_size
    envs = tuple(cluster.rank_env(r, 0) for r in range(n))  # the launcher overrides the torchrun vars
    return Placement(
        master_addr=str(cluster.master_addr),
        envs=envs,
        info=cluster.summary(),
        prefixes=tuple(tuple(cluster.rank_command_prefix(r)) for r in range(n)),
    )


@contextlib.contextmanager
def local_placement(world_size: int) -> Iterator[Placement]:
    """``cluster=local``: a context manager (like :func:`emulated_placement`) giving :data:`LOCAL`."""
    yield LOCAL


@contextlib.contextmanager
def emulated_placement(
    world_size: int, ranks_per_node: int, inter_gbps: float, inter_latency_ms: float, *, device: str = "cpu"
) -> Iterator[Placement]:
    """``cluster=emulated``: build the namespaces (experiments/cluster), yield their placement, tear down.

    ``device`` is the requested ``launcher.device``; ``cuda`` is refused (:func:`device_for_cluster`).
    """
    device_for_cluster(device, "emulated")
    try:
        cluster = EmulatedCluster(
            nodes=world_size // ranks_per_node,
            ranks_per_node=ranks_per_node,
            inter_gbps=inter_gbps,
            inter_latency_ms=inter_latency_ms,
        )
        cluster.__enter__()
    except (NetnsError, ValueError) as e:  # the messages already say how to run with cluster=local
        raise PlacementError(f"cluster=emulated cannot build its namespaces: {e}") from e
    except ClusterInterrupted as e:  # Ctrl-C / SIGTERM while the namespaces were built or probed
        raise _interrupted(e) from None
    try:
        yield cluster_placement(cluster)
    except ClusterInterrupted as e:  # ... or before the launcher's own handlers took over
        raise _interrupted(e) from None
    finally:
        cluster.__exit__(None, None, None)


def _interrupted(e: ClusterInterrupted) -> RunInterrupted:
    """The emulator's teardown-on-signal as the launcher reports an interrupt (one ``error:`` line,
    128 + N), instead of a silent exit."""
    name = signal.Signals(e.signum).name
    return RunInterrupted(f"interrupted by {name}; the emulated cluster was removed", exit_code=128 + e.signum)


def launch(
    *,
    module: str,
    spec: dict,
    run_dir: Path,
    world_size: int,
    ranks_per_node: int,
    placement_cm: contextlib.AbstractContextManager,
    timeout_s: float,
    grace_s: float,
    heartbeat_s: float = 0.0,
    extra_env: dict[str, str] | None = None,
) -> dict:
    """The runner's launch: write ``run_dir/ranks/spec.json``, run ``python -m <module> <spec.json>``
    on every rank inside the placement, and return the placement's ``info`` for the summary.
    ``heartbeat_s`` (``launcher.heartbeat_s``; 0: off) names and stops a silent rank (the worker
    beats through ``zeropp.experiments.launch.heartbeat``)."""
    spec_path = run_dir / "ranks" / "spec.json"
    spec_path.parent.mkdir(parents=True, exist_ok=True)
    spec_path.write_text(json.dumps(spec, indent=1, default=str))
    with placement_cm as placement:
        launch_world(
            ModuleEntry(module=module, args=(str(spec_path),)),
            world_size,
            placement=placement,
            log_dir=run_dir / "ranks",
            timeout_s=timeout_s,
            grace_s=grace_s,
            extra_env=extra_env,
            ranks_per_node=ranks_per_node,
            heartbeat_s=heartbeat_s or None,
        )
        return dict(placement.info)


__all__: Sequence[str] = (
    "PlacementError",
    "RankFailure",
    "RunInterrupted",
    "cluster_placement",
    "device_for_cluster",
    "emulated_placement",
    "in_torchrun",
    "launch",
    "local_placement",
    "worker_module",
)
