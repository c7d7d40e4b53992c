"""Our ZeRO-3 vs PyTorch FSDP2 on the same CPU gloo world: step time and peak memory.

    python -m experiments.bench_fsdp                      # 4 ranks, GPT "small", fp32
    python -m experiments.bench_fsdp --preset medium --batch 8 --steps 10 --precision bf16

Each trainer runs in its own freshly spawned world (so one's memory peak cannot hide the
other's), on the same model initialisation, the same per-rank batches and the same AdamW
hyper-parameters. FSDP2 shards with ``fully_shard`` per transformer block plus the root, as its
documentation recommends; ours is ``ZeroEngine`` at stage 3 (optionally with ZeRO++ switches).

Step time: before each step all ranks meet at a barrier (not timed); a step's time is the
slowest rank's; the median over the measured steps (after ``--warmup``) is reported.
Peak memory: per rank, peak RSS (``ru_maxrss``) minus the RSS just before the model was built,
i.e. what training added on top of the interpreter, torch and the process group; the largest
rank is reported. The goal is ratios <= 1 (ours no slower and no bigger than FSDP2).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import queue
import resource
import socket
import statistics
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _batches(args: argparse.Namespace, step: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7919 * step + rank)
    x = torch.randint(0, 256, (args.batch, args.seq + 1), generator=g)  # [B, T+1]
    return [(x[:, :-1].contiguous(), x[:, 1:].contiguous())]


def _model(args: argparse.Namespace):
    from zeropp.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig.preset(args.preset, seq_len=args.seq))


def _fsdp2_trainer(args: argparse.Namespace):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = _model(args)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) \
        if args.precision == "bf16" else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    def step(batches):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for idx, tgt in batches:
            _, loss = model(idx, tgt)
            (loss / len(batches)).backward()
            total += float(loss.detach())
        opt.step()
        t = torch.tensor([total / len(batches)], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t) / dist.get_world_size()

    return step, lambda: None


def _ours_trainer(args: argparse.Namespace):
    from zeropp.comm import Topology
    from zeropp.runtime import OptimizerConfig, ZeroConfig, ZeroEngine

    cfg = ZeroConfig(stage=3, precision=args.precision, prefetch_depth=args.prefetch,
                     qwz_bits=args.qwz, hpz=args.hpz, qgz_bits=args.qgz)
    topo = Topology.from_world(dist.get_world_size(), args.world // args.nodes)
    eng = ZeroEngine(_model(args), config=cfg, optimizer=OptimizerConfig(lr=args.lr, weight_decay=0.01), topology=topo)
    return (lambda batches: eng.train_step(batches).loss), eng.close


def _worker(rank: int, world: int, port: int, which: str, args: argparse.Namespace, results: Any) -> None:
    # FSDP2 warns that the root returns a view (the loss); nothing here modifies it in place.
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=args.timeout))
    try:
        # import both trainers' code before the baseline so neither is charged for module memory
        for mod in ("torch.distributed.fsdp", "zeropp.runtime"):
            importlib.import_module(mod)

        base_rss = _rss_bytes()
        step, close = (_ours_trainer if which == "ours" else _fsdp2_trainer)(args)
        times, losses = [], []
        for s in range(args.warmup + args.steps):
            dist.barrier()
            t0 = time.perf_counter()
            losses.append(step(_batches(args, s, rank)))
            dt = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
            if s >= args.warmup:
                times.append(float(dt))
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base_rss
        close()
        results.put((rank, {"step_s": statistics.median(times), "peak_bytes": peak, "losses": losses}))
    except BaseException as e:  # noqa: BLE001 - report to the parent instead of hanging it
        results.put((rank, {"error": f"{type(e).__name__}: {e}"}))
        raise
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(which: str, args: argparse.Namespace) -> dict[str, Any]:
    """Spawn ``args.world`` gloo ranks running ``which`` (``ours`` or ``fsdp2``); aggregate their results."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, args.world, port, which, args, results), daemon=True)
             for r in range(args.world)]
    for p in procs:
        p.start()
    out: dict[int, dict] = {}
    deadline = time.monotonic() + args.timeout
    try:
        while len(out) < args.world:
            try:
                rank, res = results.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(f"{which}: world failed or timed out (exit codes {[p.exitcode for p in procs]})")
                continue
            if "error" in res:
                raise RuntimeError(f"{which} rank {rank}: {res['error']}")
            out[rank] = res
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return {"step_s": max(r["step_s"] for r in out.values()),
            "peak_bytes": max(r["peak_bytes"] for r in out.values()),
            "losses": out[0]["losses"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=4, help="ranks (processes) in the gloo world")
    p.add_argument("--nodes", type=int, default=1, help="emulated nodes for our Topology (hpZ / qgZ routing)")
    p.add_argument("--preset", default="small", help="zeropp.models GPT preset: tiny, small, medium, large")
    p.add_argument("--seq", type=int, default=64, help="sequence length")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=8, help="measured steps")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps first")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--prefetch", type=int, default=1, help="our prefetch depth")
    p.add_argument("--qwz", type=int, default=None, help="our qwZ bits (default off)")
    p.add_argument("--hpz", action="store_true", help="our hpZ on")
    p.add_argument("--qgz", type=int, default=None, help="our qgZ bits (default off)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--timeout", type=float, default=600, help="seconds before a world is killed")
    args = p.parse_args(argv)
    if args.world % args.nodes:
        p.error(f"--nodes {args.nodes} must divide --world {args.world}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    ours = run_world("ours", args)
    fsdp = run_world("fsdp2", args)
    mb = 1024 * 1024
    print(f"GPT {args.preset} seq {args.seq}, batch {args.batch}/rank, {args.world} ranks (gloo, CPU), {args.precision}, "
          f"median of {args.steps} steps after {args.warmup} warm-up")
    print(f"{'':24}{'zeropp stage 3':>16}{'FSDP2':>12}{'ours/FSDP2':>12}")
    print(f"{'step time (ms)':24}{ours['step_s'] * 1e3:16.1f}{fsdp['step_s'] * 1e3:12.1f}{ours['step_s'] / fsdp['step_s']:12.2f}")
    print(f"{'peak memory (MiB)':24}{ours['peak_bytes'] / mb:16.1f}{fsdp['peak_bytes'] / mb:12.1f}"
          f"{ours['peak_bytes'] / max(fsdp['peak_bytes'], 1):12.2f}")
    print(f"{'loss, first step':24}{ours['losses'][0]:16.4f}{fsdp['losses'][0]:12.4f}")
    print(f"{'loss, last step':24}{ours['losses'][-1]:16.4f}{fsdp['losses'][-1]:12.4f}")
    return {"ours": ours, "fsdp2": fsdp, "time_ratio": ours["step_s"] / fsdp["step_s"],
            "memory_ratio": ours["peak_bytes"] / max(fsdp["peak_bytes"], 1)}


if __name__ == "__main__":
    main()
