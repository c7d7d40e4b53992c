"""Cluster emulator: one network namespace per node, a shaped bridge between them; and its probes.

``emulator.py`` (:class:`EmulatedCluster`), ``netns.py`` (the namespaces, veths and shaping),
``probe.py`` (the link's TCP rate and RTT, measured at setup), ``ring_probe.py`` (gloo's ring rate
over the shaped link; ``python -m experiments.ring_probe``) and ``check.py`` (a rank program that
checks a world's wiring). Imports no other room (the table allows the projection).

Public API::

    from zeropp.experiments.cluster import EmulatedCluster, ClusterPrivilegeError
    with EmulatedCluster(nodes=2, ranks_per_node=2, inter_gbps=1.0) as c:
        argv = c.rank_command_prefix(rank) + [sys.executable, "-m", "..."]
        env = {**os.environ, **c.rank_env(rank, master_port)}
        c.measured_gbps, c.summary()

Ranks are started in the namespaces by the one launcher (``experiments/launch/``, with
``placement=experiments.runner.launcher.cluster_placement(c)``; the runner's ``cluster=emulated``).
This package does not import the launcher, so the launcher can import it.

CLI: ``python -m experiments.cluster up|down|status|clean`` (see ``__main__.py``).
"""

from .emulator import (
    DEFAULT_SUBNET,
    MAX_GBPS,
    MAX_LATENCY_MS,
    MIN_GBPS,
    ClusterInterrupted,
    ClusterSpec,
    EmulatedCluster,
    link_problem,
)
from .netns import ClusterPrivilegeError, NetnsError, clean, list_namespaces, require_privileges, stale_namespaces
from .probe import measure_rtt, measure_throughput

__all__ = [
    "DEFAULT_SUBNET",
    "MAX_GBPS",
    "MAX_LATENCY_MS",
    "MIN_GBPS",
    "ClusterInterrupted",
    "ClusterPrivilegeError",
    "ClusterSpec",
    "EmulatedCluster",
    "NetnsError",
    "clean",
    "link_problem",
    "list_namespaces",
    "measure_rtt",
    "measure_throughput",
    "require_privileges",
    "stale_namespaces",
]
