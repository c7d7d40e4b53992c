"""One rank's whole life: join the process group, train, measure, and (rank 0) write the results.

Started by the launcher as ``python -m <pkg>.worker <spec.json>`` (env: RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT), or called in-process under torchrun via :func:`run_rank`. A rank
that raises writes its traceback to ``<run dir>/ranks/rank<r>.err`` (the launcher prints it) and
exits 1 at once, without waiting on peers that may be stuck in a collective.

Fault injection for testing the failure path: ``ZEROPP_INJECT_FAULT=raise@<rank>:<step>`` makes
that rank raise at that step, ``kill@<rank>:<step>`` makes it SIGKILL itself.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .commwatch import CommWatch
from .config import RunConfig, from_dict
from .console import Progress, summary_table
from .data import TokenBatches
from .launcher import LAUNCHED_MARK
from .metrics import MetricsFile, build_summary, tokens_per_step, write_summary
from .trainers import build_trainer
from .wandb_log import WandbLogger, flatten


def _maybe_fault(rank: int, step: int) -> None:
    spec = os.environ.get("ZEROPP_INJECT_FAULT", "")
    if not spec:
        return
    kind, _, where = spec.partition("@")
    r, _, s = where.partition(":")
    if int(r) == rank and int(s or 0) == step:
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"injected fault on rank {rank} at step {step} (ZEROPP_INJECT_FAULT={spec})")


def _watch_parent() -> None:
    """Exit if the launcher disappears (backs up PR_SET_PDEATHSIG, e.g. behind a command prefix)."""
    parent = os.getppid()

    def loop() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=loop, daemon=True, name="zeropp-parent-watch").start()


def _device(cfg: RunConfig, local_rank: int) -> tuple[torch.device, str]:
    want = cfg.launcher.device
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()
                          and torch.cuda.device_count() >= cfg.topology.ranks_per_node):
        if not torch.cuda.is_available():
            raise RuntimeError("launcher.device=cuda but CUDA is not available; use launcher.device=cpu")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def _zeropp_topology(cfg: RunConfig) -> Any:
    """zeropp.comm.Topology for the trainers that use zeropp's collectives."""
    if cfg.trainer.name in ("fsdp2", "ddp"):
        return None
    return cfg.topology.zeropp()


def _count_params(cfg: RunConfig) -> int:
    """Exact parameter count of the full (unsharded) model, built on the meta device."""
    try:
        from .trainers import build_model

        with torch.device("meta"):
            m = build_model(cfg, torch.device("meta"))
        return sum(p.numel() for p in m.parameters())
    except Exception:  # noqa: BLE001 - fall back to the GPT-2 layout formula
        return cfg.model.num_params()


def _delta(now: dict[str, int] | None, before: dict[str, int] | None) -> dict[str, int] | None:
    if now is None:
        return None
    before = before or {}
    return {k: v - before.get(k, 0) for k, v in now.items() if v - before.get(k, 0)}


def _add(acc: dict[str, float], d: dict[str, int] | None) -> None:
    for k, v in (d or {}).items():
        acc[k] = acc.get(k, 0) + v


def run_rank(spec: dict[str, Any]) -> dict[str, Any] | None:
    """Train one rank; returns the summary on rank 0 (None elsewhere)."""
    cfg = from_dict(spec["config"])
    run_dir = Path(spec["run_dir"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank % cfg.topology.ranks_per_node))
    if world != cfg.topology.world_size:
        raise RuntimeError(f"WORLD_SIZE={world} from the launcher but topology.world_size="
                           f"{cfg.topology.world_size}; override topology.world_size={world}")
    lws = os.environ.get("LOCAL_WORLD_SIZE")
    if lws is not None and int(lws) != cfg.topology.ranks_per_node and rank == 0:
        # fine for an emulated topology on one machine; on a real cluster intra/cross would be mislabelled
        print(f"warning: LOCAL_WORLD_SIZE={lws} but topology.ranks_per_node={cfg.topology.ranks_per_node}: "
              "links are labelled by the topology, not by the real machines", file=sys.stderr, flush=True)
    device, backend = _device(cfg, local_rank)
    if device.type == "cpu":
        torch.set_num_threads(cfg.launcher.threads_per_rank)
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=cfg.launcher.pg_timeout_s))
    try:
        return _train(cfg, spec, run_dir, rank, world, device, backend)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _train(cfg: RunConfig, spec: dict[str, Any], run_dir: Path, rank: int, world: int,
           device: torch.device, backend: str) -> dict[str, Any] | None:
    t = cfg.train
    n_params = _count_params(cfg)
    data = TokenBatches(cfg.data, seq_len=cfg.model.seq_len, batch=t.micro_batch_size,
                        vocab_size=cfg.model.vocab_size, seed=t.seed, rank=rank, device=device)
    trainer = build_trainer(cfg, device, _zeropp_topology(cfg))
    lead = rank == 0
    metrics = MetricsFile(run_dir / "metrics.jsonl") if lead else None
    wb = WandbLogger(cfg.logger, run_dir=run_dir, name=spec.get("name") or cfg.describe(),
                     group=spec.get("group"), config=cfg.to_dict() | {"overrides": spec.get("overrides", [])}) \
        if lead else None
    progress = Progress(t.steps, enabled=lead and cfg.launcher.progress)
    tps_step = tokens_per_step(cfg)
    wire_tot: dict[str, float] = {}
    eng_tot: dict[str, float] | None = None
    wait_tot, eng_wait_tot, measured = 0.0, 0.0, 0
    step_times: list[float] = []
    losses: list[float] = []
    prev_eng = trainer.comm_stats()
    with CommWatch(cfg.topology.zeropp()) as watch:
        dist.barrier()
        watch.take()
        for step in range(1, t.steps + 1):
            _maybe_fault(rank, step)
            batches = [data.next() for _ in range(t.grad_accum)]
            t0 = time.perf_counter()
            out = trainer.train_step(batches)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            wire, wait = watch.take()
            eng_now = trainer.comm_stats()
            eng = _delta(eng_now, prev_eng)
            prev_eng = eng_now
            if step > t.warmup_steps:
                measured += 1
                wait_tot += wait
                eng_wait_tot += out.comm_wait_s or 0.0
                _add(wire_tot, wire)
                if eng is not None:
                    eng_tot = eng_tot or {}
                    _add(eng_tot, eng)
            red = torch.tensor([out.loss, wait, dt, out.comm_wait_s or 0.0], dtype=torch.float64)
            dist.all_reduce(red)  # global mean loss / wait / step time for the log line
            red /= world
            watch.take()  # the line's own all-reduce is not training traffic
            loss, wait_mean, _, eng_wait_mean = (float(x) for x in red)
            losses.append(loss)
            step_times.append(dt)
            evl = None
            if t.eval_every and step % t.eval_every == 0 and step < t.steps:
                evl = trainer.eval_loss(*data.eval_batch())
                watch.take()
            if lead and (step % t.log_every == 0 or step == t.steps):
                rec = {"step": step, "loss": loss, "grad_norm": out.grad_norm, "skipped": out.skipped,
                       "step_time_s": dt, "tokens_per_s": tps_step / dt if dt > 0 else None,
                       "comm_wait_s": wait_mean,
                       "engine_comm_wait_s": eng_wait_mean if out.comm_wait_s is not None else None,
                       "comm_bytes": wire, "engine_comm_bytes": eng,
                       "eval_loss": evl}
                assert metrics is not None and wb is not None
                metrics.write(rec)
                wb.log(flatten({k: v for k, v in rec.items() if k != "step" and v is not None}), step=step)
            progress.update(step, loss=loss, step_time=dt, tokens_per_s=tps_step / dt if dt > 0 else 0.0)
        eval_loss = trainer.eval_loss(*data.eval_batch())
        watch.take()
    report = {"rank": rank, "wire_bytes": wire_tot, "engine_bytes": eng_tot, "wait_s": wait_tot,
              "engine_wait_s": eng_wait_tot,
              "measured_steps": measured, "memory": trainer.memory_report()}
    gathered: list[Any] = [None] * world if lead else []
    dist.gather_object(report, gathered if lead else None, dst=0)
    trainer.close()
    if not lead:
        return None
    notes = list(spec.get("notes", []))
    summary = build_summary(cfg=cfg, rank_reports=gathered, step_times=step_times, losses=losses,
                            eval_loss=eval_loss, n_params=n_params, run_dir=str(run_dir),
                            overrides=spec.get("overrides", []), device=str(device), backend=backend,
                            notes=notes)
    assert metrics is not None and wb is not None
    metrics.close()
    summary["wandb_dir"] = wb.dir
    write_summary(run_dir / "summary.json", summary)
    wb.finish(flatten({k: v for k, v in summary.items() if k not in ("config", "loss", "memory_per_rank")}))
    print(summary_table(summary), flush=True)
    return summary


def main(argv: list[str]) -> int:
    """Entry of a spawned rank: run, or record the error for the launcher and exit 1."""
    spec = json.loads(Path(argv[1]).read_text())
    rank = int(os.environ.get("RANK", "0"))
    if LAUNCHED_MARK in os.environ:
        _watch_parent()
    try:
        run_rank(spec)
    except BaseException:  # noqa: BLE001 - everything goes to the launcher
        tb = traceback.format_exc()
        err = Path(spec["run_dir"]) / "ranks" / f"rank{rank}.err"
        try:
            err.parent.mkdir(parents=True, exist_ok=True)
            err.write_text(tb)
        finally:
            sys.stderr.write(f"[rank {rank}] {tb}")
            sys.stderr.flush()
            os._exit(1)  # peers may be stuck in a collective with us: do not wait for them
    sys.stdout.flush()
    sys.stderr.flush()
    return 0


if __name__ == "__main__":
    rc = main(sys.argv)
    os._exit(rc)  # skip interpreter teardown (gloo threads can make it slow)
