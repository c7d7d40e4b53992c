"""One rank's whole life: join the process group, train, measure, and (rank 0) write the results.

Started by the launcher as ``python -m <pkg>.worker <spec.json>``, or called in-process under
torchrun through :func:`run_rank`; the env contract is torch's (RANK, WORLD_SIZE, LOCAL_RANK =
this process's index on its host, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT). The device follows
``launcher.device`` and LOCAL_RANK (one GPU per local process); every tensor this module hands to
a collective lives on that device. The process group is always destroyed; a rank that fails
alone aborts it instead (``zeropp.comm.context.close_process_groups``), so its peers are not left blocked
in a collective.

The loop (:func:`_train`) composes small collaborators, each testable alone against a fake
trainer: ``train_data.TrainData`` (batches and the step cursor), ``train_eval.Evaluator``,
``train_checkpoint.Checkpointer`` (resume, save, the divergence rule's interaction with
checkpoints) and ``train_metrics.RunMetrics`` (per-step means and records, wandb, progress, the
summary). The trainer is reached through the ``trainers.Trainer`` protocol only.

Divergence (``zeropp.runtime.divergence.DivergenceGuard``): each step's loss, gradient norm and
skip flag are all-reduced with the log line's figures, so every rank judges the same numbers and
stops at the same step, before that step's eval and checkpoint; rank 0 writes the metrics line and
``summary.json`` (``"status": "diverged"``), then every rank raises ``DivergenceError`` and exits 3.

A SIGTERM (how launchers stop ranks) is raised in the main thread as torch's ``SignalException``
(and a SIGINT as ``KeyboardInterrupt``), never inside the standard library's own lock code
(``zeropp.interrupts.raise_when_safe``: one that landed in the heartbeat's ``Event.set`` left the
Event's lock held and the stop blocked on it), so the rank unwinds like on any error (the process
group destroyed, the nvme tier's swap files removed) instead of dying where it stands; then it
exits quietly with 128 + the signal
(:func:`stopped_status`: 143, 130 for a SIGINT), without a traceback: being stopped is not the
rank's error, and the launcher (or torchrun) that stopped it says so once. Where it was (every
thread's stack) goes to the rank's own log (``ranks/rank<r>.log``), for a run the timeout or the
heartbeat monitor stopped. A SIGTERM that lands while the rank unwinds from its own error leaves
that error the rank's (:func:`own_error`): it propagates, noting the stop. The rank marks its progress with
``zeropp.experiments.launch.heartbeat`` on paths every rank takes; phases that may legitimately be long
(start-up and model creation, checkpoint load and save, the first step, the end) are announced
as such (see ``zeropp.watch``).

Fault injection for testing the failure path: ``ZEROPP_INJECT_FAULT=<kind>@<rank>:<step>`` at the
start of that step on that rank: ``raise`` raises, ``kill`` SIGKILLs the rank, ``stop`` SIGSTOPs
it (a stopped process), ``hang`` sleeps in the main thread for good (a deadlock; other threads
run on).
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, NoReturn, TextIO

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import get_error_handler, record

from zeropp import watch
from zeropp.comm import context as comm_context
from zeropp.comm.objects import all_gather_json
from zeropp.interrupts import end_start_up, interrupt_when_safe, raise_when_safe
from zeropp.runtime.divergence import DivergenceError

from ..launch import heartbeat, select_device
from ..launch.failure import PEER_ERRORS
from .commwatch import CommWatch
from .config import RunConfig, from_dict
from .launcher import device_for_cluster
from .profiling import StepProfiler
from .train_checkpoint import Checkpointer, divergence_guard
from .train_data import TrainData
from .train_eval import Evaluator
from .train_metrics import RunMetrics
from .trainers import build_trainer


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


_stopped_by: list[signal.Signals] = []  # the signal that stopped this rank's current run_rank, once it came
_stack_log: list[Path] = []  # the rank's own log (main() sets it): where a stop writes the rank's stacks


def _log_stacks(signum: int) -> None:
    """Write where every thread of this rank was when signal ``signum`` stopped it (a run stopped by
    ``launcher.timeout_s`` or the heartbeat monitor: where the ranks were stuck) to the rank's own
    log; never to a terminal, which stays quiet. Best effort: the stop goes on if it cannot."""
    try:
        f: TextIO
        if _stack_log:
            sys.stderr.flush()  # rank > 0: the same file as its stderr; keep the order
            f = open(_stack_log[0], "a")  # noqa: SIM115 - closed below, after faulthandler wrote to its fd
        elif not sys.stderr.isatty():  # under torchrun: its log (or the job's output file)
            f = sys.stderr
        else:
            return
        try:
            name = signal.Signals(signum).name
            print(f"rank {os.environ.get('RANK')} (pid {os.getpid()}) stopped by {name} here:", file=f, flush=True)
            faulthandler.dump_traceback(file=f, all_threads=True)
            f.flush()
        finally:
            if f is not sys.stderr:
                f.close()
    except (OSError, ValueError, AttributeError):
        pass


def _raise_on_sigterm(signum: int, frame: Any) -> None:
    """Turn the launcher's SIGTERM into an exception once; a repeated SIGTERM (the launcher signals
    a stopped rank before continuing it, and torch's process context signals again) is ignored, so
    the first exception's ``finally`` blocks (destroying the process group) run to the end."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _stopped_by.append(signal.Signals(signum))
    _log_stacks(signum)  # where it was stuck, for the rank's log only
    stop = SignalException(
        f"rank {os.environ.get('RANK')} (pid {os.getpid()}) was stopped by {signal.Signals(signum).name}",
        sigval=signal.Signals(signum),
    )
    raise_when_safe(frame, stop)  # not inside a lock's own code (the heartbeat's Event.set): the stop would hang on it


def stopped_status(e: BaseException) -> int | None:
    """128 + N when signal N stopped this rank and ``e`` is how it left: the ``SignalException`` of
    :func:`_raise_on_sigterm` (or of torch's handlers), ``KeyboardInterrupt`` for SIGINT, or any
    error raised after the stop, which is its consequence (a checkpoint save the signal broke off
    reports a ``CheckpointError`` on every rank; a collective whose peer left fails). None for an
    error of the rank's own, also one the stop interrupted while the rank was unwinding from it
    (:func:`own_error`). A rank so stopped exits with that status and no traceback."""
    if own_error(e) is not None:
        return None  # the stop came while the rank was unwinding from its own error
    if isinstance(e, SignalException):
        return 128 + int(e.sigval)
    if isinstance(e, KeyboardInterrupt):
        return 128 + int(signal.SIGINT)
    if _stopped_by:
        return 128 + int(_stopped_by[0])
    return None


def _chain(e: BaseException) -> list[BaseException]:
    """``e``, then what it was raised from or during (``__cause__``, else ``__context__``), and so on."""
    out: list[BaseException] = []
    x: BaseException | None = e
    while x is not None and all(x is not y for y in out):
        out.append(x)
        x = x.__cause__ or x.__context__
    return out


def own_error(e: BaseException) -> BaseException | None:
    """The rank's own error that a stop (``SignalException``, ``KeyboardInterrupt``) in ``e``'s chain
    interrupted: the launcher's SIGTERM (a failing peer's, the timeout's) may land while this rank
    unwinds from its own error, and the stop then carries that error only as its ``__context__``.
    None when the chain holds no error from before a stop (errors after it are its consequence), or
    only errors a peer's exit caused (``PEER_ERRORS``: a Ctrl-C stops every rank, and the rank that
    leaves first closes its connections under the others' collectives: their stop, not their error)."""
    chain = _chain(e)
    first = next((i for i, x in enumerate(chain) if isinstance(x, (SignalException, KeyboardInterrupt))), None)
    if first is None:
        return None
    before = [x for x in chain[first + 1 :] if not isinstance(x, (SignalException, KeyboardInterrupt))]
    return next((x for x in before if not any(p in str(x) for p in PEER_ERRORS)), None)


def raise_own_error(e: BaseException) -> NoReturn:
    """Raise the rank's own error of ``e`` (:func:`own_error`, else ``e``) with its traceback, for
    ``@record`` and the rank's log, noting the stop that came while the rank unwound from it."""
    own = own_error(e)
    if own is None:
        raise e
    stop = next(x for x in _chain(e) if isinstance(x, (SignalException, KeyboardInterrupt)))
    own.add_note(f"(while the rank unwound from this error it was stopped: {type(stop).__name__}: {stop})")
    raise own from None


def run_rank(spec: dict[str, Any]) -> dict[str, Any] | None:
    """Train one rank; returns the summary on rank 0 (None elsewhere). A run that diverges raises
    :class:`DivergenceError` on every rank, after rank 0 has written its summary. A stop by a
    signal raises (:func:`stopped_status` tells it from the rank's own errors)."""
    heartbeat("startup", long=True)  # model creation and the rendezvous with slower-starting ranks
    _stopped_by.clear()
    old_term = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    own_int = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if own_int:  # Ctrl-C: Python's KeyboardInterrupt, but not inside a lock
        signal.signal(signal.SIGINT, interrupt_when_safe)
    try:
        return _run_rank(spec)
    finally:
        signal.signal(signal.SIGTERM, old_term)
        if own_int:
            signal.signal(signal.SIGINT, signal.default_int_handler)


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
    agreed = True  # the ranks leave together: a finished run, or a divergence every rank stopped at
    try:
        return _train(cfg, spec, Path(spec["run_dir"]), rank, world, device, backend)
    except DivergenceError:
        raise
    except BaseException:
        agreed = False
        raise
    finally:
        comm_context.close_process_groups(aborted=not agreed)  # peers not left blocked when this rank fails alone


def _train(
    cfg: RunConfig, spec: dict[str, Any], run_dir: Path, rank: int, world: int, device: torch.device, backend: str
) -> dict[str, Any] | None:
    """The training loop, composed of its collaborators: data (``train_data``), evaluation
    (``train_eval``), checkpoints and the divergence rule (``train_checkpoint``), measurements
    (``train_metrics``); the trainer is used through the ``trainers.Trainer`` protocol only."""
    t = cfg.train
    lead = rank == 0
    data = TrainData(cfg, rank, device)
    trainer = build_trainer(cfg, device)
    choice = getattr(trainer.comm_session(), "transport", None)  # zero.transport, as the ranks resolved it
    if lead and choice is not None and choice.requested != choice.resolved:
        print(f"zeropp: zero.{choice}", file=sys.stderr, flush=True)
    ckpt = Checkpointer(cfg, run_dir, trainer, lead=lead)
    start = ckpt.resume()
    data.skip_steps(start)
    evaluator = Evaluator(trainer, data, t)
    metrics = RunMetrics(cfg, spec, run_dir, rank=rank, world=world, device=device, start=start)
    guard = divergence_guard(cfg)
    diverged: DivergenceError | None = None
    metrics.begin(trainer)
    unprofiled = [s for s in t.profiled_steps if s <= start]
    if unprofiled and lead:
        print(
            f"warning: train.profile_steps {unprofiled} come before step {start + 1}, where this resumed run "
            "starts; they are not profiled",
            file=sys.stderr,
            flush=True,
        )
    prof = StepProfiler(t.profiled_steps, start=start, run_dir=run_dir, rank=rank, device=device)
    with CommWatch(cfg.topology, sessions=[trainer.comm_session()]) as comm, prof:
        dist.barrier()
        comm.take()
        for step in range(start + 1, t.steps + 1):
            _maybe_fault(rank, step)
            heartbeat("train_step", step, long=step == start + 1)  # the first step builds kernels
            batches = data.step_batches()
            t0 = time.perf_counter()
            with prof.step(step):
                out = trainer.train_step(batches)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                dt = time.perf_counter() - t0  # before the profiler saves a recorded step's trace
            wire, wait = comm.take()
            stats = metrics.observe(step, out, dt, wire, wait, trainer)  # collective: the means over ranks
            comm.take()  # the means' own all-reduce is not training traffic
            heartbeat("step_end", step)  # ends the first step's long phase
            try:
                note = guard.check(step, stats.loss, stats.grad_norm, stats.skipped, loss_scale=out.loss_scale)
            except DivergenceError as e:
                diverged, note = ckpt.explain(e, step), None
            if note and lead:
                print(f"warning: {note}", file=sys.stderr, flush=True)
            evl = None
            if diverged is None and evaluator.due(step):
                heartbeat("eval", step)
                evl = evaluator.run()
                comm.take()
            if ckpt.after_step(step, diverged=diverged is not None):
                comm.take()
            metrics.log(stats, evl, last=diverged is not None)
            if diverged is not None:
                break
        metrics.progress.close()
        heartbeat("final_eval")
        eval_loss = None if diverged is not None else evaluator.run()
        comm.take()
    if diverged is None and lead and (note := guard.final_warning()):
        print(f"warning: {note}", file=sys.stderr, flush=True)
    report = metrics.rank_report(trainer)
    heartbeat("finish", long=True)  # rank 0 writes the results (and may sync wandb) while the others exit
    # through the comm context, not dist.gather_object: for ranks other than 0 this is the last
    # collective before exit (zeropp.comm.objects says why that matters)
    gathered = all_gather_json(report, device=device)
    trainer.close()
    summary = None
    if lead:
        summary = metrics.finish(
            gathered,
            eval_loss=eval_loss,
            backend=backend,
            checkpoint=ckpt.saved,
            diverged=diverged,
            skipped_steps=guard.skipped_steps,
        )
    if diverged is not None:
        dist.barrier()  # no rank leaves (and makes the launcher stop the others) before rank 0 has written
        raise diverged
    return summary


@record  # a rank's exception goes to torch's error file, which the launcher reads to name the failing rank
def main(argv: list[str]) -> int:
    """Entry of a launched rank: ``python -m <pkg>.worker <spec.json>``. A diverged run exits with
    ``DivergenceError.exit_code`` on every rank, without a traceback: the error goes to torch's
    error file (for the launcher), and ranks other than 0 print it to their log; rank 0 prints
    nothing, the runner prints the message once from the summary. A rank stopped by a signal (the
    launcher's SIGTERM on Ctrl-C, ``timeout`` or a failing peer) exits with 128 + the signal once
    its cleanup has run, also without a traceback; ranks other than 0 note it in their log (which
    names the rank if it was stopped alone, by someone else)."""
    end_start_up()  # outside run_rank's own handler, a SIGTERM ends the rank at once, also in a C wait
    rank = int(os.environ.get("RANK", "0"))
    _stack_log[:] = [Path(argv[1]).parent / f"rank{rank}.log"]  # the launcher's log_dir holds the spec
    try:
        run_rank(json.loads(Path(argv[1]).read_text()))
        code = 0
    except DivergenceError as e:
        get_error_handler().record_exception(e)
        if rank != 0:
            print(f"error: {e}", file=sys.stderr)
        code = e.exit_code
    except (Exception, KeyboardInterrupt) as e:
        stopped = stopped_status(e)
        if stopped is None:
            raise_own_error(e)  # the rank's own error, also one a stop interrupted while unwinding from it
        if rank != 0:
            print(f"rank {rank} (pid {os.getpid()}) stopped by {signal.Signals(stopped - 128).name}", file=sys.stderr)
        code = stopped
    sys.stdout.flush()
    sys.stderr.flush()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv))
