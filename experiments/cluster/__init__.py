"""Cluster emulator: one network namespace per node, a shaped bridge between them.

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

from .emulator import DEFAULT_SUBNET, ClusterSpec, EmulatedCluster
from .netns import ClusterPrivilegeError, NetnsError, clean, list_namespaces, require_privileges, stale_namespaces
from .probe import measure_rtt, measure_throughput

__all__ = [
    "DEFAULT_SUBNET",
    "ClusterPrivilegeError",
    "ClusterSpec",
    "EmulatedCluster",
    "NetnsError",
    "clean",
    "list_namespaces",
    "measure_rtt",
    "measure_throughput",
    "require_privileges",
    "stale_namespaces",
]
