"""`EmulatedCluster`: N "nodes" on one machine whose cross-node traffic crosses a shaped link.

Layout (all of it inside namespaces this class creates; the host's root namespace is untouched):

    <p>-<id>-sw   switch namespace: bridge <p>-br, ports <p>-p0 .. <p>-p{N-1}
    <p>-<id>-n0   node 0: lo + veth <p>-up (10.213.0.1/24) <-> <p>-p0 on the bridge
    <p>-<id>-n1   node 1: lo + veth <p>-up (10.213.0.2/24) <-> <p>-p1 on the bridge ...

Each node's uplink is shaped both ways with tbf (node-side `<p>-up` egress = upload, switch-side
`<p>-pI` egress = download), plus netem delay when a latency is asked for (half of it on each of
the two egress points a packet crosses, so node-to-node one-way latency = inter_latency_ms).
Kernels without netem (the 2026 dev box's, for one) get a clear error for inter_latency_ms > 0;
rate shaping needs only tbf. TCP's slow-start restart after idle is off inside the node
namespaces (`netns.keep_tcp_window_when_idle`), as on a datacentre fabric.
Ranks of node i run inside `<p>-<id>-n<i>` with GLOO_SOCKET_IFNAME=<p>-up: gloo binds the
node's address, peers on the same node reach it through the namespace's local routing (no
shaping, like NVLink/PCIe inside a real node) and peers on other nodes through the shaped link.

Teardown runs on `__exit__`, at interpreter exit and on SIGINT/SIGTERM, is idempotent, and first
kills whatever still runs inside the node namespaces (e.g. a rank that hung after a peer died).
Namespaces left by an owner that was SIGKILLed are found and removed on the next `up()`.
"""

from __future__ import annotations

import atexit
import ipaddress
import itertools
import math
import signal
import sys
import threading
from dataclasses import asdict, dataclass
from types import FrameType
from typing import Any

from zeropp.interrupts import stands_in_for_sigterms_default

from . import netns
from .probe import measure_rtt, measure_throughput

DEFAULT_SUBNET = "10.213.0.0/24"

MIN_GBPS, MAX_GBPS = 1e-3, 400.0
"""Cross-node rates the emulator shapes, Gbit/s. tbf needs at least a byte per second and sizes
its queue (50 ms of traffic, :class:`netns.Shaping`) in 32-bit bytes, which overflows above about
680 Gbit/s; one host's loopback carries far less than 400 anyway. A rate outside is nearly always
a unit slip (bit/s or Mbit/s typed where Gbit/s is meant), refused before anything is built rather
than reported by ``tc`` after the namespaces are up."""
MAX_LATENCY_MS = 1000.0
"""Largest one-way cross-node latency, ms: a second is beyond any cluster fabric (a unit slip, s or
us typed as ms), and a step would spend its collective timeout waiting."""


def link_problem(gbps: float, latency_ms: float, *, gbps_key: str, latency_key: str) -> str | None:
    """Why ``gbps`` / ``latency_ms`` cannot be emulated (naming the caller's keys), or None."""
    if not (math.isfinite(gbps) and MIN_GBPS <= gbps <= MAX_GBPS):
        return (
            f"{gbps_key}={gbps:g} is not a rate the emulator can shape: give Gbit/s from {MIN_GBPS:g} to "
            f"{MAX_GBPS:g} (1 Gbit/s is 1, not 1e9)"
        )
    if not (math.isfinite(latency_ms) and 0 <= latency_ms <= MAX_LATENCY_MS):
        return f"{latency_key}={latency_ms:g} is not a one-way latency the emulator adds: give ms from 0 to {MAX_LATENCY_MS:g}"
    return None


class ClusterInterrupted(SystemExit):
    """SIGINT / SIGTERM reached the cluster's owner while the cluster was up and no other handler
    was installed: the cluster is torn down and this ends the process with 128 + N, as the signal
    would have. A caller that reports interruptions (the runner) turns it into its own one line;
    before, the process ended silently with 143."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


@dataclass(frozen=True)
class ClusterSpec:
    """What to emulate. inter_latency_ms is one-way node-to-node latency (RTT = 2x)."""

    nodes: int
    ranks_per_node: int
    inter_gbps: float
    inter_latency_ms: float = 0.0
    prefix: str = "zpp"
    subnet: str = DEFAULT_SUBNET
    probe_seconds: float = 1.0

    def __post_init__(self) -> None:
        netns.check_prefix(self.prefix)
        if self.nodes < 1 or self.ranks_per_node < 1:
            raise ValueError(
                f"cluster needs nodes >= 1 and ranks_per_node >= 1, got {self.nodes}x{self.ranks_per_node}"
            )
        problem = link_problem(
            self.inter_gbps,
            self.inter_latency_ms,
            gbps_key="cluster.inter_gbps",
            latency_key="cluster.inter_latency_ms",
        )
        if problem:
            raise ValueError(problem)
        net = ipaddress.ip_network(self.subnet)
        if not net.is_private or net.num_addresses - 2 < self.nodes:
            raise ValueError(f"subnet {self.subnet} must be private and hold {self.nodes} node addresses")


class EmulatedCluster:
    """Context manager that builds the namespaces on enter and removes them on exit.

    >>> with EmulatedCluster(nodes=2, ranks_per_node=2, inter_gbps=1) as c:   # doctest: +SKIP
    ...     cmd = c.rank_command_prefix(rank) + [sys.executable, "-m", "my.worker"]
    ...     env = {**os.environ, **c.rank_env(rank, master_port=29500)}
    """

    _ids = itertools.count()
    BRIDGE_SUFFIX, UPLINK_SUFFIX = "br", "up"

    def __init__(
        self,
        nodes: int,
        ranks_per_node: int,
        inter_gbps: float,
        inter_latency_ms: float = 0.0,
        prefix: str = "zpp",
        *,
        subnet: str = DEFAULT_SUBNET,
        probe: bool = True,
        probe_seconds: float = 1.0,
    ) -> None:
        self.spec = ClusterSpec(nodes, ranks_per_node, inter_gbps, inter_latency_ms, prefix, subnet, probe_seconds)
        self.probe = probe
        self.cluster_id = f"{netns.owner_tag()}-{next(self._ids)}"
        self.measured_gbps: float | None = None
        self.measured_rtt_ms: float | None = None
        self.cleaned_stale: list[str] = []
        self._created: list[str] = []
        self._up = False
        self._lock = threading.Lock()
        self._prev_handlers: dict[int, Any] = {}

    # ------------------------------------------------------------------ names and addresses
    @property
    def world_size(self) -> int:
        return self.spec.nodes * self.spec.ranks_per_node

    @property
    def switch_namespace(self) -> str:
        return f"{self.spec.prefix}-{self.cluster_id}-sw"

    def node_namespace(self, node: int) -> str:
        self._check_node(node)
        return f"{self.spec.prefix}-{self.cluster_id}-n{node}"

    def node_address(self, node: int) -> str:
        self._check_node(node)
        return str(ipaddress.ip_network(self.spec.subnet)[node + 1])

    @property
    def interface(self) -> str:
        """The uplink's name inside every node namespace: what GLOO_SOCKET_IFNAME must name."""
        return f"{self.spec.prefix}-{self.UPLINK_SUFFIX}"

    @property
    def master_addr(self) -> str:
        return self.node_address(0)

    def node_of(self, rank: int) -> int:
        """Ranks fill nodes in blocks (ranks 0..rpn-1 on node 0), like zeropp.comm.Topology."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        return rank // self.spec.ranks_per_node

    def rank_command_prefix(self, rank: int) -> list[str]:
        """Prepend to a rank's argv so it runs inside its node's namespace (same pid, env kept)."""
        return ["ip", "netns", "exec", self.node_namespace(self.node_of(rank))]

    def rank_env(self, rank: int, master_port: int) -> dict[str, str]:
        """Environment entries for `rank` (merge into os.environ): rendezvous + gloo interface.

        Every emulated node lives on this one host, so LOCAL_RANK is the rank's index on the host
        (the rank itself) and LOCAL_WORLD_SIZE the whole world, as torchrun would set them for one
        host: a per-node LOCAL_RANK would put ranks of different nodes on the same GPU.
        """
        return {
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(master_port),
            "RANK": str(rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(self.world_size),
            "GLOO_SOCKET_IFNAME": self.interface,
        }

    def namespaces(self) -> list[str]:
        return [self.switch_namespace] + [self.node_namespace(i) for i in range(self.spec.nodes)]

    def summary(self) -> dict[str, Any]:
        """What a run's summary.json should record about the link (configured and measured)."""
        return {
            "cluster": "emulated",
            **{k: v for k, v in asdict(self.spec).items() if k != "probe_seconds"},
            "measured_gbps": self.measured_gbps,
            "measured_rtt_ms": self.measured_rtt_ms,
            "namespaces": self.namespaces(),
            "node_addresses": [self.node_address(i) for i in range(self.spec.nodes)],
        }

    def _check_node(self, node: int) -> None:
        if not 0 <= node < self.spec.nodes:
            raise ValueError(f"node {node} outside cluster of {self.spec.nodes} nodes")

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> EmulatedCluster:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> EmulatedCluster:
        """Check privileges, clean stale namespaces, build, shape, probe. Tears down on any failure."""
        s = self.spec
        netns.require_privileges(s.prefix)
        if s.inter_latency_ms > 0 and not netns.qdisc_supported("netem", s.prefix):
            raise netns.NetnsError(
                f"cluster.inter_latency_ms={s.inter_latency_ms} needs the netem qdisc, which this kernel lacks "
                "(CONFIG_NET_SCH_NETEM / module sch_netem). Set cluster.inter_latency_ms=0 (rate shaping alone "
                "works) or run on a kernel with netem."
            )
        self.cleaned_stale = netns.clean(s.prefix)
        self._install_handlers()
        self._up = True
        try:
            self._build()
            if self.probe and s.nodes >= 2:
                self.run_probe()
        except BaseException:
            self.down()
            raise
        return self

    def _build(self) -> None:
        s = self.spec
        sw, bridge = self.switch_namespace, f"{s.prefix}-{self.BRIDGE_SUFFIX}"
        netns.add_namespace(sw)
        self._created.append(sw)  # after the add: a namespace of that name that was there before is not ours to delete
        netns.add_bridge(sw, bridge)
        prefix_len = ipaddress.ip_network(s.subnet).prefixlen
        # Half the latency on each egress point: node->switch, then switch->other node.
        shaping = netns.Shaping.for_rate(s.inter_gbps, s.inter_latency_ms / 2)
        for i in range(s.nodes):
            ns, port = self.node_namespace(i), f"{s.prefix}-p{i}"
            netns.add_namespace(ns)
            self._created.append(ns)
            netns.add_uplink(ns, self.interface, sw, port, bridge, f"{self.node_address(i)}/{prefix_len}")
            netns.keep_tcp_window_when_idle(ns)  # a fabric, not a WAN: no slow start after each compute phase
            netns.shape_egress(ns, self.interface, shaping)
            netns.shape_egress(sw, port, shaping)

    def run_probe(self, attempts: int = 3) -> float:
        """Measure node 0 -> node 1 TCP throughput and RTT; store and return Gbit/s.

        The shaper caps the rate from above; a busy CPU can only make one probe read low. So a
        probe more than 10% under the configured rate is repeated (up to `attempts`) and the best
        kept: the number recorded is what the link can carry, not how loaded the host was.
        """
        s = self.spec
        server, client = self.rank_command_prefix(s.ranks_per_node), self.rank_command_prefix(0)
        addr = self.node_address(1)
        max_bytes = int(s.inter_gbps * 1e9 / 8 * s.probe_seconds * 2) + (1 << 20)
        best = 0.0
        for _ in range(max(1, attempts)):
            best = max(best, measure_throughput(server, client, addr, seconds=s.probe_seconds, max_bytes=max_bytes))
            if best >= 0.9 * s.inter_gbps:
                break
        self.measured_gbps = best
        self.measured_rtt_ms = measure_rtt(server, client, addr)
        return best

    def down(self) -> None:
        """Kill processes inside our namespaces and delete them. Safe to call any number of times."""
        with self._lock:
            if not self._up:
                return
            self._up = False
            # Nodes first (their veth ends take the switch ports with them), the switch last.
            for ns in sorted(self._created, key=lambda n: n.endswith("-sw")):
                try:
                    netns.delete_namespace(ns)
                except Exception as e:
                    print(f"[zeropp.cluster] could not delete namespace {ns}: {e}", file=sys.stderr)
            self._created.clear()
            self._restore_handlers()

    # ------------------------------------------------------------------ signals
    def _install_handlers(self) -> None:
        """Teardown on SIGINT/SIGTERM and at exit; SIGKILL is covered by stale cleanup next time."""
        atexit.register(self.down)
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            prev = signal.getsignal(sig)
            if prev == signal.SIG_IGN:
                continue  # the parent asked us to ignore it (e.g. `cmd &` ignores SIGINT): keep doing so
            self._prev_handlers[sig] = prev
            signal.signal(sig, self._on_signal)

    def _restore_handlers(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig, prev in self._prev_handlers.items():
                if signal.getsignal(sig) == self._on_signal:
                    signal.signal(sig, prev)
        self._prev_handlers.clear()
        atexit.unregister(self.down)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        prev = self._prev_handlers.get(signum)
        self.down()
        if callable(prev) and not (signum == signal.SIGTERM and stands_in_for_sigterms_default(prev)):
            prev(signum, frame)  # e.g. Python's default SIGINT handler raises KeyboardInterrupt
        else:
            raise ClusterInterrupted(signum)
