"""One rank's whole life: join the process group, train, measure, and (rank 0) write the results.

Started by the launcher as ``python -m <pkg>.worker <spec.json>``, or called in-process under
torchrun through :func:`run_rank`; the env contract is torch's (RANK, WORLD_SIZE, LOCAL_RANK =
this process's index on its host, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT). The device follows
``launcher.device`` and LOCAL_RANK (one GPU per local process); every tensor this module hands to
a collective lives on that device. The process group is always destroyed, also on error.

Divergence (``zeropp.runtime.divergence.DivergenceGuard``): each step's loss, gradient norm and
skip flag are all-reduced with the log line's figures, so every rank judges the same numbers and
stops at the same step, before that step's eval and checkpoint; rank 0 writes the metrics line and
``summary.json`` (``"status": "diverged"``), then every rank raises ``DivergenceError`` and exits 3.

A SIGTERM (how launchers stop ranks) is raised in the main thread as torch's ``SignalException``,
so the rank unwinds like on any error (the process group destroyed, the nvme tier's swap files
removed) instead of dying where it stands. The rank marks its progress with
``zeropp.launch.heartbeat`` on paths every rank takes; phases that may legitimately be long
(start-up and model creation, checkpoint load and save, the first step, the end) are announced
as such (see ``zeropp.watch``).

Fault injection for testing the failure path: ``ZEROPP_INJECT_FAULT=<kind>@<rank>:<step>`` at the
start of that step on that rank: ``raise`` raises, ``kill`` SIGKILLs the rank, ``stop`` SIGSTOPs
it (a stopped process), ``hang`` sleeps in the main thread for good (a deadlock; other threads
run on).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import get_error_handler, record

from zeropp import watch
from zeropp.comm.backend import backend_all_reduce
from zeropp.comm.objects import all_gather_json
from zeropp.launch import heartbeat, select_device
from zeropp.runtime.divergence import DivergenceError, DivergenceGuard

from .commwatch import CommWatch
from .config import RunConfig, from_dict
from .console import Progress, print_summary
from .data import TokenBatches
from .launcher import device_for_cluster
from .metrics import MetricsFile, build_summary, tokens_per_step, write_memory_json, write_summary
from .profiling import StepProfiler
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
        if kind == "stop":
            watch.flush()  # the launcher's "last seen" is this rank's last beat, however loaded the machine
            os.kill(os.getpid(), signal.SIGSTOP)
            return  # continued (SIGCONT): carry on as if nothing happened
        if kind == "hang":
            while True:
                time.sleep(3600)
        raise RuntimeError(f"injected fault on rank {rank} at step {step} (ZEROPP_INJECT_FAULT={spec})")


def _delta(now: dict[str, int] | None, before: dict[str, int] | None) -> dict[str, int] | None:
    if now is None:
        return None
    before = before or {}
    return {k: v - before.get(k, 0) for k, v in now.items() if v - before.get(k, 0)}


def _add(acc: dict[str, float], d: dict[str, int] | None) -> None:
    for k, v in (d or {}).items():
        acc[k] = acc.get(k, 0) + v


def _resume_keys(cfg: RunConfig) -> dict[str, Any]:
    """The settings a resumed run must keep to continue exactly as an uninterrupted one (the world
    size and stage may change: the checkpoint reshards)."""
    return json.loads(
        json.dumps(
            {
                "train.seed": cfg.train.seed,
                "train.micro_batch_size": cfg.train.micro_batch_size,
                "train.steps": cfg.train.steps,
                "zero.grad_accum_steps": cfg.zero.grad_accum_steps,
                "data": dataclasses.asdict(cfg.data),
                "optim": dataclasses.asdict(cfg.optim),
            }
        )
    )


def _evaluate(trainer: Any, data: TokenBatches, batches: int, rank: int, world: int) -> float:
    """Mean held-out loss over ``batches`` rounds; in round k rank r evaluates held-out batch
    ``k * world + r`` (each ``trainer.eval_loss`` call is collective: the mean over ranks)."""
    return sum(trainer.eval_loss(*data.eval_batch(k * world + rank)) for k in range(batches)) / batches


def _frozen_bytes(trainer: Any) -> int:
    """Bytes of the stage-3 frozen shards this rank stores (quantized with ``zero.quantize_frozen``)."""
    engine = getattr(trainer, "engine", None)
    if engine is None or not getattr(engine, "frozen_units", None):
        return 0
    from zeropp.runtime.frozen import frozen_bytes

    return frozen_bytes(engine.frozen)


def _memory_phases(trainer: Any, device: torch.device, created: Any) -> dict[str, dict[str, Any]]:
    """Per-phase, per-tier memory of this rank: the engine's own snapshots (``memory_phases``), or
    for trainers without them the flat report after model creation and after the last step."""
    from zeropp.runtime import memory as mem

    eng = getattr(trainer, "engine", None)
    if eng is not None and hasattr(eng, "memory_phases"):
        return {k: v.to_dict() for k, v in eng.memory_phases().items()}
    out = {"model_creation": created.to_dict()} if created is not None else {}
    out["step"] = mem.flat_snapshot("step", trainer.memory_report(), device).to_dict()
    return out


def _guard(cfg: RunConfig) -> DivergenceGuard:
    """The run's divergence rule, its advice in the runner's config keys."""
    if cfg.zero.precision == "fp16":
        advice = (
            f"lower zero.loss_scale_init (now {cfg.zero.loss_scale_init:g}) or optim.lr (now {cfg.optim.lr:g}), "
            "or train in bf16 (zero.precision=bf16)"
        )
    else:
        clip = (
            "set zero.grad_clip=1.0"
            if cfg.zero.grad_clip is None
            else f"clip harder (zero.grad_clip is {cfg.zero.grad_clip:g})"
        )
        advice = f"lower optim.lr (now {cfg.optim.lr:g}), {clip}, or check the data for bad values"
    return DivergenceGuard(
        loss_scaling=cfg.zero.precision == "fp16",
        max_skipped_steps=cfg.train.max_skipped_steps,
        advice=advice,
        max_skipped_name="train.max_skipped_steps",
    )


def _raise_on_sigterm(signum: int, frame: Any) -> None:
    """Turn the launcher's SIGTERM into an exception once; a repeated SIGTERM (the launcher signals
    a stopped rank before continuing it, and torch's process context signals again) is ignored, so
    the first exception's ``finally`` blocks (destroying the process group) run to the end."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SignalException(
        f"rank {os.environ.get('RANK')} (pid {os.getpid()}) was stopped by {signal.Signals(signum).name}",
        sigval=signal.Signals(signum),
    )


def run_rank(spec: dict[str, Any]) -> dict[str, Any] | None:
    """Train one rank; returns the summary on rank 0 (None elsewhere). A run that diverges raises
    :class:`DivergenceError` on every rank, after rank 0 has written its summary."""
    heartbeat("startup", long=True)  # model creation and the rendezvous with slower-starting ranks
    old_term = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        return _run_rank(spec)
    finally:
        signal.signal(signal.SIGTERM, old_term)


def _run_rank(spec: dict[str, Any]) -> dict[str, Any] | None:
    cfg = from_dict(spec["config"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    device, backend = select_device(device_for_cluster(cfg.launcher.device, cfg.cluster.name), local_rank, local_world)
    if device.type == "cpu":
        torch.set_num_threads(cfg.launcher.threads_per_rank)
    dist.init_process_group(
        backend,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=cfg.launcher.pg_timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    try:
        return _train(cfg, spec, Path(spec["run_dir"]), rank, world, device, backend)
    finally:
        dist.destroy_process_group()


def _train(
    cfg: RunConfig, spec: dict[str, Any], run_dir: Path, rank: int, world: int, device: torch.device, backend: str
) -> dict[str, Any] | None:
    t = cfg.train
    accum = cfg.zero.grad_accum_steps
    # the ranks of a tensor-parallel group compute on the same batches: data is split over dp only
    dp_rank, dp_world = cfg.topology.dp_index(rank), cfg.topology.dp_size
    data = TokenBatches(
        cfg.data,
        seq_len=cfg.model.seq_len,
        batch=t.micro_batch_size,
        vocab_size=cfg.model.vocab_size,
        seed=t.seed,
        rank=dp_rank,
        device=device,
    )
    trainer = build_trainer(cfg, device)
    from zeropp.runtime import memory as mem

    created = (
        None
        if hasattr(getattr(trainer, "engine", None), "memory_phases")
        else mem.flat_snapshot("model_creation", trainer.memory_report(), device)
    )
    ckpt = cfg.checkpoint_dir(run_dir)
    start = 0
    lead = rank == 0
    if cfg.resume:
        heartbeat("checkpoint_load", long=True)
        extra = trainer.load(ckpt)
        start = int(extra["step"])
        if start >= t.steps:
            raise RuntimeError(
                f"the checkpoint in {ckpt} is at step {start} and train.steps={t.steps}: this run "
                "already finished; to train further raise train.steps (the default LR schedule "
                "spans train.steps, so it changes too)"
            )
        changed = sorted(k for k, v in _resume_keys(cfg).items() if extra.get("run", {}).get(k, v) != v)
        if changed and lead:
            print(
                f"warning: resumed with changed settings {changed}: training continues from the checkpoint "
                "but will not match an uninterrupted run",
                file=sys.stderr,
                flush=True,
            )
        data.skip(start * accum)
    label = spec.get("label") or cfg.describe()
    metrics = MetricsFile(run_dir / "metrics.jsonl", first_step=start + 1) if lead else None
    wb = (
        WandbLogger(
            cfg.logger,
            run_dir=run_dir,
            name=spec.get("name") or label,
            group=spec.get("group"),
            config=cfg.to_dict() | {"overrides": spec.get("overrides", [])},
        )
        if lead
        else None
    )
    progress = Progress(t.steps, start=start, enabled=lead and cfg.launcher.progress)
    tps_step = tokens_per_step(cfg)
    wire_tot: dict[str, float] = {}
    eng_tot: dict[str, float] | None = None
    wait_tot, eng_wait_tot, measured = 0.0, 0.0, 0
    step_times: list[float] = []
    losses: list[float] = []
    saved: str | None = None
    saved_step = start if cfg.resume else None  # the newest checkpoint's step, for the divergence message
    guard = _guard(cfg)
    diverged: DivergenceError | None = None
    prev_eng = trainer.comm_stats()
    skipped = [s for s in t.profiled_steps if s <= start]
    if skipped and lead:
        print(
            f"warning: train.profile_steps {skipped} come before step {start + 1}, where this resumed run starts; "
            "they are not profiled",
            file=sys.stderr,
            flush=True,
        )
    prof = StepProfiler(t.profiled_steps, start=start, run_dir=run_dir, rank=rank, device=device)
    with CommWatch(cfg.topology, sessions=[trainer.comm_session()]) as watch, prof:
        dist.barrier()
        watch.take()
        for step in range(start + 1, t.steps + 1):
            _maybe_fault(rank, step)
            heartbeat("train_step", step, long=step == start + 1)  # the first step builds kernels
            batches = [data.next() for _ in range(accum)]
            t0 = time.perf_counter()
            with prof.step(step):
                out = trainer.train_step(batches)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                dt = time.perf_counter() - t0  # before the profiler saves a recorded step's trace
            wire, wait = watch.take()
            eng_now = trainer.comm_stats()
            eng = _delta(eng_now, prev_eng)
            prev_eng = eng_now
            if step > t.throughput_skip_steps:
                measured += 1
                wait_tot += wait
                eng_wait_tot += out.comm_wait_s or 0.0
                _add(wire_tot, wire)
                if eng is not None:
                    eng_tot = eng_tot or {}
                    _add(eng_tot, eng)
            # global mean loss / wait for the log line, and the divergence guard's inputs, on the
            # process group's device (NCCL: the GPU). The norm is global already; reducing it with the
            # loss and the skip flag gives every rank bitwise the same inputs, hence the same verdict
            red = torch.tensor(
                [out.loss, wait, out.comm_wait_s or 0.0, out.grad_norm or 0.0, float(out.skipped)],
                dtype=torch.float64,
                device=device,
            )
            backend_all_reduce(red, dist.ReduceOp.SUM, None, async_op=False)  # held by the comm context
            loss, wait_mean, eng_wait_mean, norm_mean, skipped_mean = (float(x) / world for x in red.tolist())
            watch.take()  # the line's own all-reduce is not training traffic
            heartbeat("step_end", step)  # ends the first step's long phase
            losses.append(loss)
            step_times.append(dt)
            try:
                note = guard.check(
                    step,
                    loss,
                    None if out.grad_norm is None else norm_mean,
                    skipped_mean > 0,
                    loss_scale=out.loss_scale,
                )
            except DivergenceError as e:
                diverged, note = e, None
                if saved_step is not None:
                    diverged = e.with_note(
                        f"Nothing of step {step} was saved; the newest checkpoint, of step {saved_step}, is in {ckpt}."
                    )
            if note and lead:
                print(f"warning: {note}", file=sys.stderr, flush=True)
            evl = None
            if diverged is None and t.eval_every and step % t.eval_every == 0 and step < t.steps:
                heartbeat("eval", step)
                evl = _evaluate(trainer, data, t.eval_batches, dp_rank, dp_world)
                watch.take()
            # nothing is saved from a diverged state: the last good checkpoint stays LATEST
            if diverged is None and t.checkpoint_every and (step % t.checkpoint_every == 0 or step == t.steps):
                heartbeat("checkpoint_save", step, long=True)
                # "model": the model's settings, so the checkpoint alone rebuilds it (python -m experiments.export)
                model_rec = cfg.to_dict()["model"]
                trainer.save(
                    ckpt, {"step": step, "run": _resume_keys(cfg), "model": model_rec}, keep=t.keep_checkpoints
                )
                saved, saved_step = str(ckpt), step
                watch.take()
            if lead and (step % t.log_every == 0 or step == t.steps or diverged is not None):
                rec = {
                    "step": step,
                    "loss": loss,
                    "grad_norm": out.grad_norm,
                    "skipped": out.skipped,
                    "lr": out.lr,
                    "step_time_s": dt,
                    "tokens_per_s": tps_step / dt if dt > 0 else None,
                    "comm_wait_s": wait_mean,
                    "engine_comm_wait_s": eng_wait_mean if out.comm_wait_s is not None else None,
                    "comm_bytes": wire,
                    "engine_comm_bytes": eng,
                    "eval_loss": evl,
                }
                assert metrics is not None and wb is not None
                metrics.write(rec)
                wb.log(flatten({k: v for k, v in rec.items() if k != "step" and v is not None}), step=step)
            progress.update(step, loss=loss, step_time=dt, tokens_per_s=tps_step / dt if dt > 0 else 0.0)
            if diverged is not None:
                break
        progress.close()
        heartbeat("final_eval")
        eval_loss = None if diverged is not None else _evaluate(trainer, data, t.eval_batches, dp_rank, dp_world)
        watch.take()
    if diverged is None and lead and (note := guard.final_warning()):
        print(f"warning: {note}", file=sys.stderr, flush=True)
    report = {
        "rank": rank,
        "wire_bytes": wire_tot,
        "engine_bytes": eng_tot,
        "wait_s": wait_tot,
        "engine_wait_s": eng_wait_tot,
        "measured_steps": measured,
        "memory": trainer.memory_report(),
        "state_params": getattr(getattr(trainer, "engine", None), "num_params", None),
        "frozen_bytes": _frozen_bytes(trainer),
        "memory_phases": _memory_phases(trainer, device, created),
    }
    heartbeat("finish", long=True)  # rank 0 writes the results (and may sync wandb) while the others exit
    # through the comm context, not dist.gather_object: for ranks other than 0 this is the last
    # collective before exit (zeropp.comm.objects says why that matters)
    gathered = all_gather_json(report, device=device)
    trainer.close()
    summary = None
    if lead:
        summary = _write_results(
            cfg,
            spec,
            run_dir,
            gathered,
            step_times,
            losses,
            eval_loss,
            device,
            backend,
            label,
            start,
            saved,
            metrics,
            wb,
            diverged,
            guard.skipped_steps,
        )
    if diverged is not None:
        dist.barrier()  # no rank leaves (and makes the launcher stop the others) before rank 0 has written
        raise diverged
    return summary


def _write_results(
    cfg: RunConfig,
    spec: dict[str, Any],
    run_dir: Path,
    gathered: list[Any],
    step_times: list[float],
    losses: list[float],
    eval_loss: float | None,
    device: torch.device,
    backend: str,
    label: str,
    start: int,
    saved: str | None,
    metrics: MetricsFile | None,
    wb: WandbLogger | None,
    diverged: DivergenceError | None,
    skipped_steps: int,
) -> dict[str, Any]:
    """Rank 0: ``summary.json`` and ``memory.json``, the logger's final record, the summary table
    (not for a diverged run: the runner's one error message says what happened)."""
    summary = build_summary(
        cfg=cfg,
        rank_reports=gathered,
        step_times=step_times,
        losses=losses,
        eval_loss=eval_loss,
        n_params=cfg.model.num_params(),
        run_dir=str(run_dir),
        overrides=spec.get("overrides", []),
        device=str(device),
        backend=backend,
        label=label,
        model_name=spec.get("model_name", ""),
        first_step=start + 1,
        divergence=None if diverged is None else diverged.record(),
        skipped_steps=skipped_steps,
    )
    summary["checkpoint"] = saved
    assert metrics is not None and wb is not None
    metrics.close()
    summary["wandb_dir"] = wb.dir
    write_summary(run_dir / "summary.json", summary)
    write_memory_json(run_dir / "memory.json", summary)
    wb.finish(
        flatten(
            {
                k: v
                for k, v in summary.items()
                if k not in ("config", "loss", "memory_per_rank", "memory_by_phase", "memory_expected", "divergence")
            }
        )
    )
    if diverged is None:
        print_summary(summary)
    return summary


@record  # a rank's exception goes to torch's error file, which the launcher reads to name the failing rank
def main(argv: list[str]) -> int:
    """Entry of a launched rank: ``python -m <pkg>.worker <spec.json>``. A diverged run exits with
    ``DivergenceError.exit_code`` on every rank, without a traceback: the error goes to torch's
    error file (for the launcher), and ranks other than 0 print it to their log; rank 0 prints
    nothing, the runner prints the message once from the summary."""
    try:
        run_rank(json.loads(Path(argv[1]).read_text()))
        code = 0
    except DivergenceError as e:
        get_error_handler().record_exception(e)
        if int(os.environ.get("RANK", "0")) != 0:
            print(f"error: {e}", file=sys.stderr)
        code = e.exit_code
    sys.stdout.flush()
    sys.stderr.flush()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv))
