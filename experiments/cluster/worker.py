"""One rank of the emulated-cluster benchmark (and of the cluster tests): train, time, report.

Why a worker of its own rather than the runner's: the benchmark runs ZeRO-3 and ZeRO++ back to
back on *one* emulated cluster (same namespaces, same measured link), and the tests need a short
training run that depends on nothing but the engine API. It is started by
``experiments.cluster.bench`` helpers as

    ip netns exec <node ns> python -m zeropp.experiments.cluster.worker --mode zeropp --out DIR ...

with RANK, WORLD_SIZE, MASTER_ADDR/PORT and GLOO_SOCKET_IFNAME from ``EmulatedCluster.rank_env``.
Each rank writes ``DIR/rank<r>.json``: step times, the engine's own time blocked on
communication, and bytes by link (intra/cross) from the engine's CommStats; with ``--quant-rates``
also the measured throughput of the quantize/dequantize ops of each quantized mode.

Modes: ``zero3`` (plain ZeRO-3), ``zeropp`` (ZeRO-3 + qwZ INT8 + hpZ + qgZ INT4), a comma list of
them (run alternately, ``--rounds`` times each, one fresh engine per run), or ``allreduce`` (no
model: gloo all_reduces, a connectivity check for tests).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

MODES = {
    "zero3": dict(stage=3),
    "zeropp": dict(stage=3, qwz_bits=8, hpz=True, qgz_bits=4),
}


def _init(timeout_s: float) -> tuple[int, int]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    return rank, world


def _allreduce_check(rank: int, world: int) -> dict[str, Any]:
    """Sum of ranks + a 4 MiB all_reduce timed: proves rendezvous and data flow across nodes."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    big = torch.ones(1 << 20)
    t0 = time.perf_counter()
    dist.all_reduce(big)
    return {"sum": float(t.item()), "expected": world * (world - 1) / 2, "big_ok": bool((big == world).all()),
            "big_s": time.perf_counter() - t0}


def _uplink_tx_bytes() -> int | None:
    """Bytes this node's uplink has sent (kernel counter, headers included), or None off-cluster.

    `ip netns exec` mounts the namespace's own /sys, so this is the emulated node's NIC: the
    ground truth of what crossed the shaped link, whatever algorithm gloo used.
    """
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    try:
        with open(f"/sys/class/net/{ifname}/statistics/tx_bytes") as f:
            return int(f.read())
    except (OSError, ValueError, TypeError):
        return None


def _train_once(mode: str, rank: int, world: int, a: argparse.Namespace) -> dict[str, Any]:
    """Build a fresh model + engine for `mode`, run warm-up + timed steps, close the engine."""
    import torch
    import torch.distributed as dist

    from zeropp.comm import Topology
    from zeropp.models import GPT, GPTConfig, byte_batch
    from zeropp.runtime import OptimizerConfig, ZeroConfig, ZeroEngine

    topo = Topology(nodes=world // a.ranks_per_node, ranks_per_node=a.ranks_per_node)
    mcfg = GPTConfig.preset(a.preset)
    torch.manual_seed(0)
    model = GPT(mcfg)
    engine = ZeroEngine(model, config=ZeroConfig(**MODES[mode], grad_clip=1.0),
                        optimizer=OptimizerConfig(lr=1e-3), topology=topo)
    gen = torch.Generator().manual_seed(1000 + rank)
    data = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=gen)
    steps, waits, losses = [], [], []
    tx0 = None
    try:
        for i in range(a.warmup + a.steps):
            batch = byte_batch(data, a.micro_batch, mcfg.seq_len, gen)
            if i == a.warmup:
                dist.barrier()
                engine.comm_stats.reset()
                tx0 = _uplink_tx_bytes()
            res = engine.train_step([batch])
            losses.append(res.loss)
            if i >= a.warmup:
                steps.append(res.step_time_s)
                waits.append(res.comm_wait_s)
        dist.barrier()
        tx1 = _uplink_tx_bytes()
        by_link = {link: engine.comm_stats.total(link=link) / a.steps for link in ("intra", "cross")}
    finally:
        engine.close()
    uplink = (tx1 - tx0) / a.steps if tx0 is not None and tx1 is not None else None
    return {"step_s": steps, "comm_wait_s": waits, "losses": losses, "bytes_per_step": by_link,
            "uplink_tx_bytes_per_step": uplink,
            "params": mcfg.num_params(), "seq_len": mcfg.seq_len,
            "model": {"vocab": mcfg.vocab_size, "seq_len": mcfg.seq_len, "d_model": mcfg.d_model,
                      "n_layers": mcfg.n_layers, "mlp_ratio": mcfg.mlp_ratio}}


def _train(rank: int, world: int, a: argparse.Namespace) -> dict[str, Any]:
    """Alternate the modes for `rounds` rounds in one process group.

    Why alternate: on a shared host the background load drifts; interleaving ZeRO-3 and ZeRO++
    runs exposes both to the same drift, and one process start (torch import, rendezvous) serves
    every run.
    """
    modes = a.mode.split(",")
    runs: dict[str, dict[str, Any]] = {}
    for _ in range(a.rounds):
        for mode in modes:
            r = _train_once(mode, rank, world, a)
            if mode not in runs:
                runs[mode] = {**r, "mode": mode}
            else:
                runs[mode]["step_s"] += r["step_s"]
                runs[mode]["comm_wait_s"] += r["comm_wait_s"]
    for r in runs.values():
        r["step_s_median"] = statistics.median(r["step_s"])
        r["comm_wait_s_median"] = statistics.median(r["comm_wait_s"])
        if a.quant_rates and any(MODES[r["mode"]].get(k) for k in ("qwz_bits", "qgz_bits")):
            r["quant_rates"] = _quant_rates(r, world, a)
    return {"runs": runs, "preset": a.preset, "micro_batch": a.micro_batch}


def _quant_rates(r: dict[str, Any], world: int, a: argparse.Namespace) -> list[list]:
    """Time this mode's quantize/dequantize ops at its exact per-rank shapes, on every rank at once
    (the same core sharing as during training), for the scaling comparison's quantization charge."""
    from ..scaling_check import emulator_cluster, measure_quant_rates

    c = emulator_cluster(world // a.ranks_per_node, a.ranks_per_node, 1.0)
    return [list(x) for x in measure_quant_rates(mode_workload(r["model"], r["mode"]), c, repeats=3)]


def mode_workload(md: dict[str, int], mode: str, **kw: Any) -> Any:
    """The scaling model's Workload of a run of this worker: the GPT of ``md`` (a report's
    ``"model"``), the ZeRO switches of ``mode``, fp32 on the wire; ``kw`` sets the rest
    (compute_s, tokens_per_rank, quant_rates)."""
    from ..scaling import Workload, gpt_units

    return Workload(units=gpt_units(vocab=md["vocab"], seq_len=md["seq_len"], d_model=md["d_model"],
                                    n_layers=md["n_layers"], mlp_ratio=md["mlp_ratio"]),
                    **{"compute_s": 0.0, "tokens_per_rank": 0, **kw}, dtype_bytes=4, **MODES[mode])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m zeropp.experiments.cluster.worker")
    p.add_argument("--mode", required=True, help=f"allreduce, or a comma list of {sorted(MODES)} (alternated)")
    p.add_argument("--rounds", type=int, default=1, help="times each mode runs (interleaved)")
    p.add_argument("--out", required=True, help="directory for rank<r>.json")
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--preset", default="medium")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--pg-timeout", type=float, default=120.0)
    p.add_argument("--quant-rates", action="store_true",
                   help="after training, time the quantization ops on every rank (scaling comparison)")
    a = p.parse_args(argv)
    import torch.distributed as dist

    bad = [m for m in a.mode.split(",") if m not in MODES] if a.mode != "allreduce" else []
    if bad:
        p.error(f"unknown mode(s) {bad}; choose allreduce or from {sorted(MODES)}")
    rank, world = _init(a.pg_timeout)
    try:
        out = _allreduce_check(rank, world) if a.mode == "allreduce" else _train(rank, world, a)
        out.update(rank=rank, world=world, ifname=os.environ.get("GLOO_SOCKET_IFNAME"))
        path = Path(a.out) / f"rank{rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
