"""CLI for the cluster emulator.

python -m experiments.cluster up --nodes 2 --ranks-per-node 2 --gbps 1 [--latency-ms 0.5] [--seconds N]
    build the cluster, probe it, print its summary and how to enter a node; hold it until
    Ctrl-C (or N seconds), then tear it down. The cluster lives exactly as long as this process.
python -m experiments.cluster status   list our namespaces, live or stale, with their qdiscs
python -m experiments.cluster clean    delete namespaces whose owning process is gone
python -m experiments.cluster down     delete *all* namespaces with the prefix (live ones too)
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import time

from zeropp.interrupts import end_start_up

from . import netns
from .emulator import ClusterInterrupted, EmulatedCluster


def main(argv: list[str] | None = None) -> int:
    end_start_up()  # the start-up SIGTERM stand-in off: a SIGTERM in a C wait ends the process at once
    p = argparse.ArgumentParser(prog="python -m experiments.cluster", description=__doc__.split("\n\n")[0])
    p.add_argument("--prefix", default="zpp")
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="build, probe and hold an emulated cluster")
    up.add_argument("--nodes", type=int, default=2)
    up.add_argument("--ranks-per-node", type=int, default=2)
    up.add_argument("--gbps", type=float, default=1.0)
    up.add_argument("--latency-ms", type=float, default=0.0)
    up.add_argument("--seconds", type=float, default=None, help="hold time (default: until Ctrl-C)")
    sub.add_parser("status", help="list namespaces with the prefix")
    sub.add_parser("clean", help="delete stale namespaces (owner process gone)")
    sub.add_parser("down", help="delete every namespace with the prefix")
    a = p.parse_args(argv)
    try:
        netns.check_prefix(a.prefix)
        if a.cmd == "up":  # a bad shape is a usage error before anything is built, not a traceback
            EmulatedCluster(a.nodes, a.ranks_per_node, a.gbps, a.latency_ms, a.prefix)
    except ValueError as e:
        p.error(str(e).replace("cluster.inter_gbps", "--gbps").replace("cluster.inter_latency_ms", "--latency-ms"))
    if a.cmd == "up" and a.seconds is not None and not (math.isfinite(a.seconds) and a.seconds >= 0):
        p.error(f"--seconds must be a finite number >= 0, got {a.seconds:g}")
    try:
        if a.cmd == "up":
            try:
                with EmulatedCluster(a.nodes, a.ranks_per_node, a.gbps, a.latency_ms, a.prefix) as c:
                    print(json.dumps(c.summary(), indent=2), flush=True)
                    print(
                        f"enter node 0: {' '.join(c.rank_command_prefix(0))} bash   (Ctrl-C here tears down)",
                        flush=True,
                    )
                    deadline = None if a.seconds is None else time.monotonic() + a.seconds
                    while deadline is None or time.monotonic() < deadline:
                        time.sleep(0.2)
            except (KeyboardInterrupt, ClusterInterrupted) as e:  # the way to end `up`: one line, not a traceback
                signum = e.signum if isinstance(e, ClusterInterrupted) else signal.SIGINT
                print(f"error: interrupted by {signal.Signals(signum).name}; the cluster was removed", file=sys.stderr)
                return 128 + signum
            return 0
        if a.cmd == "status":
            names = netns.list_namespaces(a.prefix)
            stale = set(netns.stale_namespaces(a.prefix))
            for ns in names:
                print(
                    f"{ns}\t{'stale' if ns in stale else 'live (owner pid ' + str(netns.owner_pid(ns, a.prefix)) + ')'}"
                )
                qd = netns.tc_ns(ns, "qdisc", "show", check=False).stdout.strip()
                for line in qd.splitlines():
                    if "noqueue" not in line:
                        print(f"    {line}")
            if not names:
                print(f"no namespaces with prefix {a.prefix}-")
            return 0
        removed = netns.clean(a.prefix, everything=a.cmd == "down")
        print("removed: " + (", ".join(removed) if removed else "nothing"))
        return 0
    except netns.NetnsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
