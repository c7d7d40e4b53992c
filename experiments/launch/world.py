"""The one way ranks are started on one host: torch's elastic multiprocessing, watched.

Used by the runner (``python -m experiments.run``, through ``zeropp.experiments.runner.launcher``), the
projection's calibration, the studies and the tests (``tests/worlds.py::run_world``); why it is a
room of its own: the package docstring::

    launch_world(ModuleEntry(module="zeropp.experiments.runner.worker", args=(spec,)), 4,
                 placement=LOCAL, log_dir=run_dir / "ranks", timeout_s=600)
    launch_world(fn, 4, args=(x,), process_group="gloo", timeout_s=60)  # -> [fn(0, 4, x), ..]

Processes come from ``torch.distributed.elastic.multiprocessing.start_processes``, the engine of
``torchrun``: a module entrypoint runs as a binary (``SubprocessContext``, each rank in its own
session), a function through ``torch.multiprocessing`` spawn (``MultiprocessContext``; its
return values come back by rank). Each rank sees the torchrun contract: ``RANK, WORLD_SIZE,
LOCAL_RANK`` (its index on *this host*, whatever node layout is emulated), ``LOCAL_WORLD_SIZE``
(processes on this host), ``MASTER_ADDR/PORT``, ``TORCHELASTIC_ERROR_FILE``, plus the
placement's per-rank env and :data:`LAUNCHED_MARK`. Under a real ``torchrun`` nothing here runs:
:func:`in_torchrun` tells the runner to be the rank itself.

Why a bootstrap in front of module ranks. ``start_processes`` takes one binary for all ranks
and ``Popen`` s it with no pre-exec hook, while a rank needs three things before the worker
starts: ``PR_SET_PDEATHSIG`` (so a SIGKILLed launcher takes its ranks along), an optional command
prefix (``ip netns exec <node ns>`` for the emulated cluster; it ``exec`` s, so the pid stays the
rank's) and one log file for stdout *and* stderr (torch's redirects open two files). The entry
binary is therefore this interpreter running :data:`BOOT` (a few lines of stdlib: prctl, check
the parent is still ours, dup2 the log, ``execvp`` the rest of argv), so every placement is the
same entrypoint with per-rank args, and nothing but the exec chain differs between local and
emulated ranks. Function ranks get the same guarantees in :func:`function_rank`.

Failure handling. Each poll first peeks every rank's exit status (``waitid(WNOWAIT)``, which
leaves the child for torch to reap), so the launcher knows which rank died *first*; then
``PContext.wait(0)`` collects torch's ``RunProcsResult``. On a failure every rank is closed with
``PContext.close(timeout=grace_s)`` (SIGTERM to each rank's process group, SIGKILL after the
grace), then each group is SIGKILLed once more so grandchildren (e.g. wandb's service) go too.
:class:`RankFailure` names the root cause, with the tail of its error (how it is chosen, and
where the error text comes from: :mod:`zeropp.experiments.launch.failure`). SIGINT/SIGTERM/SIGHUP/SIGQUIT to the launcher
(handlers restored afterwards) and the whole-run timeout stop all ranks the same way. While the
ranks start, torch's handlers raise its ``SignalException``; once they run, the launcher's own
handlers only note the signal, and the watch loop stops the world at its next poll: an exception
raised wherever the signal lands can be swallowed there (a finalizer, a logging handler, any
``except Exception``: ``SignalException`` is one), and the launcher then watched on with its ranks
training, a single ``kill`` lost. A stop first sends SIGTERM to every rank and then SIGCONT to its
group, so a stopped rank handles its SIGTERM as soon as it continues.

Silent ranks (``heartbeat_s``): a rank that is alive but no longer heard from (SIGSTOPped,
deadlocked, stuck in I/O) would otherwise only surface when a peer's collective times out, blamed
on that peer. With ``heartbeat_s`` the ranks publish heartbeats (:func:`heartbeat` from the
worker's main thread, plus a daemon thread proving the process runs) and the watch loop names
the silent rank within ``heartbeat_s`` and stops the world; the rule, which tells the silent rank
from the peers waiting for it, is in :mod:`zeropp.watch`.

What a world leaves behind: every world gets a private directory (``mkdtemp`` in ``log_dir``, else
in the temporary directory; removed at the end) and a random run id, both in the ranks' env
(:mod:`zeropp.watch`). Scratch directories a rank names with :func:`zeropp.watch.scratch_prefix`
(the nvme tier's swap files) are removed after the world ends, also those of SIGKILLed ranks;
only this run's, never another run's in the same directory. A SIGKILLed *launcher* cleans
nothing (its ranks die by PDEATHSIG; their folders carry the run id in their names).

Logs: rank 0 keeps the terminal; with ``log_dir`` the other ranks write ``<log_dir>/rank<r>.log``
and torch's error files land under ``<log_dir>/elastic/`` (``DefaultLogsSpecs`` layout
``test_run_id_*/attempt_0/<local rank>/error.json``: we set no ``TORCHELASTIC_RUN_ID``, which
would make ``torch.distributed.is_torchelastic_launched()`` claim an elastic agent); without it
all ranks share the terminal and the error files live in a temporary directory removed afterwards.

API: :func:`launch_world` (``ModuleEntry`` or function), :class:`Placement` (:data:`LOCAL`; the
emulated cluster's is built in ``zeropp.experiments.runner.launcher``), :func:`select_device`,
:func:`free_port`, :func:`in_torchrun`, :data:`LAUNCHED_MARK`, :func:`heartbeat` (rank side, from
:mod:`zeropp.watch`); errors :class:`RankFailure` (from :mod:`zeropp.experiments.launch.failure`),
:class:`PlacementError`. Launch from the main thread: PDEATHSIG fires when the *thread* that
started a rank exits.

CUDA (:func:`select_device`): one GPU per process on its host, chosen by ``LOCAL_RANK``. The
emulated cluster is CPU only (``zeropp.experiments.runner.launcher.device_for_cluster``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, PContext, SignalException, start_processes

from zeropp import watch

from .boot import BOOT, function_rank
from .failure import RankFailure, RunInterrupted, exit_status, root_cause
from .placement import LAUNCHED_MARK, LOCAL, ModuleEntry, Placement, PlacementError, free_port

_TORCH_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)  # start_processes' handlers


def _not_a_closing_notice(record: logging.LogRecord) -> bool:
    """torch's "Sending process N closing signal SIGTERM", one warning line per rank, logged while
    :meth:`_World.stop` closes the ranks: the launcher's own message (``all ranks stopped``,
    ``stopped ranks [...]``) says it once. Its other warnings (a rank that had to be killed) stay."""
    return not str(record.msg).startswith("Sending process")


_TORCH_LOG = logging.getLogger(PContext.__module__)


# ---------------------------------------------------------------------------------- launching


def _unreaped(pid: int) -> bool:
    """``pid`` is still our child (running, or exited but not yet reaped): its number cannot have
    been reused, so signalling it cannot reach a stranger."""
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


def _signal_groups(pids: Sequence[int], sig: signal.Signals) -> None:
    """Send ``sig`` to each rank's process group (SIGKILL: what is left of it, grandchildren such
    as wandb's service; SIGCONT: a stopped rank, so it handles the SIGTERM already sent)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)


@dataclasses.dataclass(kw_only=True)
class _World:
    """One started world: torch's process context plus what failure reports need."""

    pc: PContext
    pids: dict[int, int]
    log_dir: Path | None
    grace_s: float
    ranks_per_node: int | None
    monitor: watch.HeartbeatMonitor | None = None

    def stop(self) -> None:
        # SIGTERM before SIGCONT: a stopped rank then handles its SIGTERM first when it continues,
        # instead of running on into a collective whose peer is already gone.
        for pid in self.pids.values():
            if _unreaped(pid):  # a reaped rank's pid may already name another process
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGTERM)
        _signal_groups(list(self.pids.values()), signal.SIGCONT)
        _TORCH_LOG.addFilter(_not_a_closing_notice)
        try:
            self.pc.close(timeout=max(self.grace_s, 0.5))  # type: ignore[arg-type]  # torch annotates int, uses float
        finally:
            _TORCH_LOG.removeFilter(_not_a_closing_notice)
        _signal_groups(list(self.pids.values()), signal.SIGKILL)

    def failure(self, first: dict[int, int], codes: dict[int, int]) -> RankFailure:
        """Stop everything and build the :class:`RankFailure` naming the root cause among ``first``."""
        t_stop = time.time()
        self.stop()
        return root_cause(
            first,
            codes,
            pids=self.pids,
            error_files=self.pc.error_files,
            log_dir=self.log_dir,
            stopped_at=t_stop,
            ranks_per_node=self.ranks_per_node,
        )


def _rank_envs(
    world_size: int, placement: Placement, port: int, extra_env: dict[str, str] | None, channel: dict[str, str]
) -> dict[int, dict[str, str]]:
    envs = {}
    for r in range(world_size):
        env = dict(extra_env or {})
        if placement.envs:
            env.update(placement.envs[r])
        env.update(
            RANK=str(r),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(r),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR=placement.master_addr,
            MASTER_PORT=str(port),
            **{LAUNCHED_MARK: str(r)},
            **channel,
        )
        envs[r] = env
    return envs


def launch_world(
    entry: ModuleEntry | Callable[..., Any],
    world_size: int,
    *,
    args: tuple = (),
    placement: Placement = LOCAL,
    log_dir: Path | None = None,
    timeout_s: float,
    grace_s: float = 5.0,
    extra_env: dict[str, str] | None = None,
    process_group: str | None = None,
    pg_timeout_s: float | None = None,
    threads: int | None = None,
    ranks_per_node: int | None = None,
    heartbeat_s: float | None = None,
    poll_s: float = 0.05,
    start_method: Literal["spawn", "forkserver"] = "spawn",
) -> list[Any]:
    """Start ``world_size`` ranks of ``entry`` on this host and wait; return their results by rank.

    ``entry``: a :class:`ModuleEntry` (results are ``None``) or a picklable module-level function,
    called as ``fn(rank, world_size, *args)`` (``process_group``, e.g. ``"gloo"``: initialised
    before and destroyed after it, or aborted when it raises so that no peer stays blocked
    (``zeropp.comm.context.abort_process_groups``), with ``pg_timeout_s`` (default
    ``timeout_s - 5``, at least 10);
    ``threads``: ``torch.set_num_threads`` first). ``log_dir``: ranks other than 0 write
    ``rank<r>.log`` there (else all ranks keep the terminal). ``timeout_s`` bounds the whole run;
    ``grace_s`` is how long a stopped rank gets between SIGTERM and SIGKILL. ``ranks_per_node``
    only names a failing rank's node in messages. ``heartbeat_s``: name and stop a rank silent for
    that long (None or 0: off; see :mod:`zeropp.watch`). Raises :class:`RankFailure` (see module doc).
    ``start_method`` (function entries): ``"forkserver"`` forks each rank from multiprocessing's
    fork server, which imports once what ``multiprocessing.set_forkserver_preload`` names (seconds
    of ``import torch`` saved per rank, for callers that start many small worlds, as the tests do);
    each rank gets the caller's whole current environment, as a spawned one does. Forked ranks are
    the server's children, not this process's: a failure is then ordered by torch's report alone.
    """
    function = not isinstance(entry, ModuleEntry)
    if start_method not in ("spawn", "forkserver") or (start_method != "spawn" and not function):
        raise ValueError(f"start_method={start_method!r}: module entries spawn; functions take 'spawn' or 'forkserver'")
    placement.check(world_size, function=function)
    if world_size < 1:
        raise PlacementError(f"world_size must be >= 1, got {world_size}")
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    # in log_dir, what a SIGKILLed launcher leaves behind stays with its run
    world_dir, run_id, channel = watch.open_world(log_dir, heartbeat_s)
    envs = _rank_envs(world_size, placement, free_port(), extra_env, channel)
    logs = {r: str(log_dir / f"rank{r}.log") if log_dir is not None and r > 0 else "" for r in range(world_size)}
    try:
        if log_dir is not None:
            (log_dir / "elastic").mkdir(parents=True, exist_ok=True)
            for path in filter(None, logs.values()):
                Path(path).write_bytes(b"")  # a fresh log per run (ranks append)
            # rank 0 keeps the terminal; a stop writes where it was to rank0.log (the runner's worker):
            # a previous run's must not be read as this one's (the failure report reads rank<r>.log)
            (log_dir / "rank0.log").unlink(missing_ok=True)
        if function:
            pg_timeout = pg_timeout_s if pg_timeout_s is not None else max(timeout_s - 5, 10)
            ep: Callable | str = function_rank
            rank_args: dict[int, tuple]
            own_env = start_method == "forkserver"
            rank_args = {
                r: (
                    entry,
                    tuple(args),
                    logs[r],
                    process_group,
                    pg_timeout,
                    threads,
                    {**os.environ, **envs[r]} if own_env else None,
                )
                for r in range(world_size)
            }
        else:
            assert isinstance(entry, ModuleEntry)
            ep = sys.executable
            rank_args = {
                r: (
                    "-I",
                    "-S",
                    "-c",
                    BOOT,
                    str(os.getpid()),
                    logs[r],
                    *(placement.prefixes[r] if placement.prefixes else ()),
                    sys.executable,
                    "-m",
                    entry.module,
                    *entry.args,
                )
                for r in range(world_size)
            }
        monitor = watch.HeartbeatMonitor(world_dir, heartbeat_s) if heartbeat_s else None
        return _start_and_watch(
            ep,
            rank_args,
            envs,
            log_dir=log_dir,
            grace_s=grace_s,
            ranks_per_node=ranks_per_node,
            monitor=monitor,
            timeout_s=timeout_s,
            poll_s=poll_s,
            start_method=start_method,
        )
    finally:
        watch.close_world(world_dir, run_id)  # every rank is gone: what they left is safe to remove


def _start_and_watch(
    ep: Callable | str,
    rank_args: dict[int, tuple],
    envs: dict[int, dict[str, str]],
    *,
    log_dir: Path | None,
    grace_s: float,
    ranks_per_node: int | None,
    monitor: watch.HeartbeatMonitor | None,
    timeout_s: float,
    poll_s: float,
    start_method: str = "spawn",
) -> list[Any]:
    """Start the ranks under torch's signal handlers, watch them, and stop whatever is left."""
    errors_cm = (
        contextlib.nullcontext(str(log_dir / "elastic"))
        if log_dir is not None
        else tempfile.TemporaryDirectory(prefix="zeropp-ranks-")
    )
    old_handlers = {s: signal.getsignal(s) for s in _TORCH_SIGNALS}  # start_processes installs its own
    world: _World | None = None
    arrived: list[int] = []  # signals that arrived while the ranks ran (the watch loop stops them)
    during_stop: list[int] = []  # signals that arrived while the ranks were being stopped

    def note(signum: int, frame: object) -> None:
        """A signal while the ranks run: noted, not raised (module doc); the watch loop stops them.
        A second one (the watch loop already stopping a failed world) hurries as :func:`hurry`."""
        arrived.append(signum)
        if len(arrived) > 1 and world is not None:
            _signal_groups(list(world.pids.values()), signal.SIGKILL)

    def hurry(signum: int, frame: object) -> None:
        """A signal while the ranks stop: no exception inside the stop (that would cut it short and
        leave ranks running); the ranks' groups are killed at once (a second Ctrl-C means hurry),
        and the signal is reported once the stop is over."""
        during_stop.append(signum)
        if world is not None:
            _signal_groups(list(world.pids.values()), signal.SIGKILL)

    with errors_cm as error_root:
        try:
            pc = start_processes(
                name="zeropp",
                entrypoint=ep,
                args=rank_args,
                envs=envs,
                logs_specs=DefaultLogsSpecs(log_dir=error_root),
                start_method=start_method,
            )
            world = _World(
                pc=pc, pids=pc.pids(), log_dir=log_dir, grace_s=grace_s, ranks_per_node=ranks_per_node, monitor=monitor
            )
            if threading.current_thread() is threading.main_thread():  # (as start_processes installs its own)
                for sig in _TORCH_SIGNALS:
                    signal.signal(sig, note)
            results = _watch(world, timeout_s=timeout_s, poll_s=poll_s, arrived=arrived)
        except SignalException as e:
            raise _interrupted(e.sigval) from None
        except RankFailure:
            if arrived:  # the signal came while a failing world was stopped: the command was interrupted
                raise _interrupted(signal.Signals(arrived[0])) from None
            raise
        finally:
            try:
                if world is not None:
                    for sig in _TORCH_SIGNALS:
                        signal.signal(sig, hurry)
                    world.stop()  # idempotent; bounded by grace_s; after a success it reaps stray grandchildren
            finally:
                for sig, handler in old_handlers.items():  # one that cannot be restored: the others still are
                    with contextlib.suppress(TypeError, ValueError):
                        signal.signal(sig, handler)
    if arrived or during_stop:  # the world had finished when the signal came: the command still stops
        raise _interrupted(signal.Signals([*arrived, *during_stop][0]))
    return results


def _interrupted(sig: signal.Signals) -> RunInterrupted:
    """The launcher stopped by ``sig``: every rank is stopped by now; the shell's status for it."""
    return RunInterrupted(f"interrupted by {sig.name}; all ranks stopped", exit_code=128 + int(sig))


def _watch(world: _World, *, timeout_s: float, poll_s: float, arrived: Sequence[int] = ()) -> list[Any]:
    """Poll until every rank is done (results by rank) or one fails or the deadline passes (raise),
    or a signal was noted in ``arrived`` (raise torch's ``SignalException`` for it)."""
    deadline = time.monotonic() + timeout_s
    next_beat_check = time.monotonic()
    codes: dict[int, int] = {}
    while True:
        if arrived:
            sig = signal.Signals(arrived[0])
            raise SignalException(f"launcher (pid {os.getpid()}) got signal {sig.name}", sigval=sig)
        first = {}
        for r, pid in world.pids.items():
            if r not in codes and (c := exit_status(pid)) is not None:
                codes[r] = c
                if c != 0:
                    first[r] = c
        if first:
            raise world.failure(first, codes)
        result = world.pc.wait(0)
        if result is not None:
            if result.is_failed():  # torch saw it between our peek and its poll
                raise world.failure({r: f.exitcode for r, f in result.failures.items()}, codes)
            return [result.return_values.get(r) for r in range(len(world.pids))]
        if world.monitor is not None and time.monotonic() >= next_beat_check:
            next_beat_check = time.monotonic() + 0.5
            verdict = world.monitor.check([r for r in world.pids if r not in codes])
            if verdict is not None:
                world.stop()
                raise RankFailure(verdict.message, rank=verdict.rank)
        if time.monotonic() > deadline:
            running = [r for r in world.pids if r not in codes]
            world.stop()
            raise RankFailure(
                f"run exceeded its timeout of {timeout_s:g}s; all ranks stopped (still running were {running})"
            )
        time.sleep(poll_s)


__all__: Sequence[str] = ("launch_world",)
