"""The shaped link's rate as the training backend uses it: gloo ring all-gathers across an
emulated cluster, timed.

Why: the emulator's setup probe (``cluster/probe.py``) measures one TCP stream's payload rate,
and the step-time models charge every cross-node byte at that rate. Training traffic is gloo's:
ring collectives that send both ways over every uplink at once (so each node's uplink also
carries the ACKs of what it receives), in steps that wait for the previous chunk. This times the
backend's own collective on the same kind of link (as NCCL's bus-bandwidth tests do for GPU
clusters), so that assumption is checked rather than made. Measured on the 2-core development
host (docs/benchmarks.md): 0.976 and 0.995 of the TCP probe at 0.2 and 1 Gbit/s -- the link
gives gloo's ring the probe's rate; what slows a training run's transfers further is the ranks'
CPUs, not the link.

``measure_ring_gbps(nodes, ranks_per_node, gbps)`` builds a fresh emulated cluster (root), runs
one process per rank inside its node's namespace, and returns the uplink rate the all-gathers
achieved: gloo's ring sends ``world - 1`` chunks over each node's uplink per all-gather
(``spec.Cluster.wire="ring"`` of the projection). ``python -m experiments.ring_probe --gbps 0.2,1`` prints it
next to the TCP probe's rate.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

from zeropp.interrupts import end_start_up

_SELF = [sys.executable, os.path.abspath(__file__)]
"""The ranks run this file directly (torch only, no package imports): the repository root, where
``zeropp/`` has no ``experiments`` folder, may be the working directory."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _rank_main(nbytes: int, repeats: int) -> None:
    """One rank (env from ``EmulatedCluster.rank_env``): warm up, then time ``repeats``
    all-gathers of ``nbytes`` per rank, each on every rank at once (a barrier first)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        world = dist.get_world_size()
        x = torch.ones(nbytes // 4)  # [n] fp32
        out = torch.empty(world * x.numel())  # [world * n]
        dist.all_gather_into_tensor(out, x)  # opens the connections
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_gather_into_tensor(out, x)
            times.append(time.perf_counter() - t0)
        t = torch.tensor(times, dtype=torch.float64)  # [repeats]: the slowest rank's time of each
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if dist.get_rank() == 0:
            print(json.dumps({"seconds": t.tolist()}), flush=True)
    finally:
        dist.destroy_process_group()


def measure_ring_gbps(
    nodes: int, ranks_per_node: int, gbps: float, *, nbytes: int = 1 << 20, repeats: int = 5, timeout_s: float = 120.0
) -> float:
    """Uplink Gbit/s of gloo ring all-gathers of ``nbytes`` per rank over a fresh ``nodes x
    ranks_per_node`` emulated cluster shaped at ``gbps`` (median of ``repeats``): each node's
    uplink carries ``(world - 1) * nbytes`` per all-gather. Needs root, like ``cluster=emulated``;
    a rank that fails or hangs raises RuntimeError (all ranks killed, cluster torn down)."""
    from . import EmulatedCluster

    if nodes < 2:
        raise ValueError(f"a cross-node rate needs nodes >= 2, got {nodes}")
    world = nodes * ranks_per_node
    with EmulatedCluster(nodes, ranks_per_node, gbps, probe=False) as c:
        port = _free_port()
        procs = [
            subprocess.Popen(
                [*c.rank_command_prefix(r), *_SELF, "--rank-main", "--nbytes", str(nbytes), "--repeats", str(repeats)],
                env={**os.environ, **c.rank_env(r, port)},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(world)
        ]
        try:
            deadline = time.monotonic() + timeout_s
            outs = []
            for r, p in enumerate(procs):
                out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
                if p.returncode != 0:
                    raise RuntimeError(f"ring probe rank {r} failed (exit {p.returncode}): {err.strip()[-1500:]}")
                outs.append(out)
        except subprocess.TimeoutExpired:
            raise RuntimeError(
                f"ring probe did not finish within {timeout_s:.0f}s (a rank hung); raise timeout_s "
                f"or check the emulated cluster with `python -m experiments.cluster up`"
            ) from None
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=5)
    seconds = json.loads(outs[0].strip().splitlines()[-1])["seconds"]
    return (world - 1) * nbytes * 8 / statistics.median(seconds) / 1e9


def main(argv: list[str] | None = None) -> None:
    end_start_up()  # the start-up SIGTERM stand-in off: a SIGTERM in a C wait ends the process at once
    ap = argparse.ArgumentParser(prog="python -m experiments.ring_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gbps", type=lambda s: [float(x) for x in s.split(",")], default=[0.2, 1.0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--nbytes", type=int, default=1 << 20, help="bytes per rank per all-gather")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.rank_main:
        _rank_main(a.nbytes, a.repeats)
        return
    from . import EmulatedCluster, NetnsError, link_problem

    # every flag before the first cluster is built (before: a ValueError traceback for --gbps 0, and
    # --nodes 1 built a cluster without a cross-node link and then blamed its probe)
    if a.nodes < 2 or a.ranks_per_node < 1:
        ap.error(f"--nodes {a.nodes} --ranks-per-node {a.ranks_per_node}: the probe needs >= 2 nodes of >= 1 rank")
    if a.nbytes < 1 or a.repeats < 1:
        ap.error(f"--nbytes {a.nbytes} --repeats {a.repeats}: give counts >= 1")
    for g in a.gbps:
        if why := link_problem(g, 0.0, gbps_key="--gbps", latency_key="--latency-ms"):
            ap.error(why)
    for g in a.gbps:
        try:
            with EmulatedCluster(a.nodes, a.ranks_per_node, g) as c:
                tcp = c.measured_gbps
        except NetnsError as e:  # no root, no iproute2, a namespace name in use: what to change, no traceback
            raise SystemExit(f"error: {e}") from None
        if tcp is None:
            raise SystemExit(f"error: the {g:g} Gbit/s cluster measured no TCP rate (its link probe did not run)")
        ring = measure_ring_gbps(a.nodes, a.ranks_per_node, g, nbytes=a.nbytes, repeats=a.repeats)
        print(
            f"{g:g} Gbit/s shaped: TCP probe {tcp:.3f}, gloo ring all-gather {ring:.3f} Gbit/s "
            f"({ring / tcp:.3f} of the probe)"
        )


if __name__ == "__main__":
    main()
