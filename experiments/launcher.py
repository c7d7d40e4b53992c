"""Start one process per rank, watch them, and never leave one behind.

Two ways to run:

* **Spawned** (default, ``python -m experiments.run``): this process starts ``world_size``
  children, ``python -m <pkg>.worker <spec.json>``, each in its own session (so a signal can
  reach it and everything it started), with ``MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK``
  set. Each child also gets ``PR_SET_PDEATHSIG`` so it dies if this process is SIGKILLed. If any
  rank exits non-zero or is killed, the rest are sent SIGTERM, then SIGKILL after a grace period,
  and :class:`RankFailure` names the first failing rank with its traceback. Ctrl-C and SIGTERM
  stop the ranks the same way. A whole-run timeout bounds a hang.
* **Under torchrun** (its env vars are present): no spawning; this process *is* a rank and runs
  :func:`worker.run_rank` directly, so the same command works on real multi-node clusters.

Rank 0 keeps the terminal (progress bar); the other ranks write ``ranks/rank<r>.log`` in the run
directory. A rank that raises writes its traceback to ``ranks/rank<r>.err`` (see worker.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Sequence

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
LAUNCHED_MARK = "ZEROPP_LAUNCHED_RANK"
"""Set in children we spawn, so a child never mistakes itself for a torchrun rank that should spawn."""

_PEER_ERRORS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                "Socket closed", "Timed out waiting", "ECONNRESET", "connectFullMesh")


class RankFailure(RuntimeError):
    """A rank failed (or the run timed out / was interrupted); the message says which and why."""

    def __init__(self, message: str, rank: int | None = None, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.exit_code = exit_code


def in_torchrun() -> bool:
    """True when torchrun (or any launcher with its env contract) started this process."""
    return all(v in os.environ for v in TORCHRUN_VARS) and LAUNCHED_MARK not in os.environ


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass(frozen=True, kw_only=True)
class Placement:
    """Where ranks run: a command prefix per rank and the rendezvous address."""

    prefixes: tuple[tuple[str, ...], ...]
    """Prepended to each rank's command (e.g. ``ip netns exec node1``); empty for local ranks."""
    master_addr: str
    """Address rank 0 listens on, reachable from every rank."""
    envs: tuple[dict[str, str], ...] = ()
    """Extra environment per rank (e.g. GLOO_SOCKET_IFNAME inside a namespace)."""
    info: dict = dataclasses.field(default_factory=dict)
    """What the run's summary should record about the placement (emulated links, measured rate)."""


@contextlib.contextmanager
def local_placement(world_size: int) -> Iterator[Placement]:
    yield Placement(prefixes=((),) * world_size, master_addr="127.0.0.1", info={"cluster": "local"})


@contextlib.contextmanager
def emulated_placement(world_size: int, ranks_per_node: int, inter_gbps: float,
                       inter_latency_ms: float) -> Iterator[Placement]:
    """The hook for ``cluster=emulated``: experiments/cluster builds the namespaces.

    Its ``EmulatedCluster`` is a context manager giving one command prefix per rank and the master
    address; the namespaces exist only inside the ``with``.
    """
    from .cluster import EmulatedCluster, NetnsError

    nodes = world_size // ranks_per_node
    try:
        cluster = EmulatedCluster(nodes=nodes, ranks_per_node=ranks_per_node, inter_gbps=inter_gbps,
                                  inter_latency_ms=inter_latency_ms)
        cluster.__enter__()
    except (NetnsError, ValueError) as e:  # the messages already say how to run with cluster=local
        raise RankFailure(f"cluster=emulated cannot build its namespaces: {e}") from e
    try:
        envs = tuple({k: v for k, v in cluster.rank_env(r, 0).items() if k not in ("MASTER_PORT",)}
                     for r in range(world_size))
        yield Placement(prefixes=tuple(tuple(cluster.rank_command_prefix(r)) for r in range(world_size)),
                        master_addr=str(cluster.master_addr), envs=envs, info=cluster.summary())
    finally:
        cluster.__exit__(None, None, None)


def _set_pdeathsig() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _describe_exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _tail(path: Path, lines: int = 30) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").rstrip().splitlines()[-lines:])
    return ""


class _Interrupted(BaseException):
    """SIGTERM/SIGINT received by the launcher while ranks run."""


@dataclasses.dataclass(kw_only=True)
class RankProcesses:
    """The children of one run; :meth:`stop` is safe to call any number of times."""

    procs: list[subprocess.Popen]
    run_dir: Path
    grace_s: float

    def stop(self) -> None:
        """SIGTERM every rank's process group, then SIGKILL what is left after the grace period."""
        for p in self.procs:
            if p.poll() is None:
                _signal_group(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(0.05)
        for p in self.procs:
            _signal_group(p.pid, signal.SIGKILL)  # also reaps grandchildren (e.g. wandb's service)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)

    def error_of(self, rank: int) -> str:
        err = self.run_dir / "ranks" / f"rank{rank}.err"
        if err.exists():
            return _tail(err, 60)
        return _tail(self.run_dir / "ranks" / f"rank{rank}.log", 30)


def spawn_ranks(*, module: str, spec_path: Path, run_dir: Path, world_size: int, ranks_per_node: int,
                placement: Placement, grace_s: float, extra_env: dict[str, str] | None = None) -> RankProcesses:
    """Start every rank as ``python -m <module> <spec_path>`` in its own session."""
    port = free_port()
    (run_dir / "ranks").mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    rp = RankProcesses(procs=procs, run_dir=run_dir, grace_s=grace_s)
    try:
        for rank in range(world_size):
            env = dict(os.environ, **(extra_env or {}))
            if placement.envs:
                env.update(placement.envs[rank])
            env.update(MASTER_ADDR=placement.master_addr, MASTER_PORT=str(port), RANK=str(rank),
                       WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank % ranks_per_node),
                       LOCAL_WORLD_SIZE=str(ranks_per_node), **{LAUNCHED_MARK: str(rank)})
            env.pop("TORCHELASTIC_RUN_ID", None)
            cmd = [*placement.prefixes[rank], sys.executable, "-m", module, str(spec_path)]
            if rank == 0:
                out = None  # inherit: progress bar and summary on the terminal
            else:
                out = open(run_dir / "ranks" / f"rank{rank}.log", "wb")  # noqa: SIM115 - child owns it
            procs.append(subprocess.Popen(cmd, env=env, cwd=os.getcwd(), stdout=out,
                                          stderr=subprocess.STDOUT if out else None,
                                          stdin=subprocess.DEVNULL, start_new_session=True,
                                          preexec_fn=_set_pdeathsig))
            if out is not None:
                out.close()
    except BaseException:
        rp.stop()
        raise
    return rp


def wait_ranks(rp: RankProcesses, *, timeout_s: float, ranks_per_node: int, poll_s: float = 0.1) -> None:
    """Block until every rank exits 0; otherwise stop them all and raise :class:`RankFailure`.

    The failing rank reported is the first seen to exit non-zero; among ranks seen failing in the
    same poll, one whose error is not a peer-connection error (the symptom of *another* rank dying)
    is preferred, so the root cause is named rather than its echo.
    """
    def on_signal(signum: int, _frame: object) -> None:
        raise _Interrupted(signal.Signals(signum).name)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            codes = [p.poll() for p in rp.procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rp.stop()
                root = [r for r in failed if not any(e in rp.error_of(r) for e in _PEER_ERRORS)]
                rank = (root or failed)[0]
                code = codes[rank]
                assert code is not None
                others = [r for r in range(len(rp.procs)) if r != rank]
                raise RankFailure(
                    f"rank {rank} (node {rank // ranks_per_node}) {_describe_exit(code)}; stopped ranks "
                    f"{others}.\n--- rank {rank} error ---\n{rp.error_of(rank) or '(no output)'}",
                    rank=rank, exit_code=code)
            if all(c == 0 for c in codes):
                rp.stop()  # nothing left to stop but stray grandchildren
                return
            if time.monotonic() > deadline:
                rp.stop()
                raise RankFailure(f"run exceeded launcher.timeout_s={timeout_s:g}s; all ranks stopped "
                                  f"(still running were {[r for r, c in enumerate(codes) if c is None]})")
            time.sleep(poll_s)
    except _Interrupted as e:
        rp.stop()
        raise RankFailure(f"interrupted by {e}; all ranks stopped", exit_code=130) from None
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def write_spec(path: Path, spec: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec, indent=1, default=str))


def launch(*, module: str, spec: dict, run_dir: Path, world_size: int, ranks_per_node: int,
           placement_cm: contextlib.AbstractContextManager, timeout_s: float, grace_s: float,
           extra_env: dict[str, str] | None = None) -> dict:
    """Write the spec, spawn the ranks inside the placement, and wait for them (see module doc).
    Returns the placement's ``info`` for the summary."""
    spec_path = run_dir / "ranks" / "spec.json"
    write_spec(spec_path, spec)
    with placement_cm as placement:
        rp = spawn_ranks(module=module, spec_path=spec_path, run_dir=run_dir, world_size=world_size,
                         ranks_per_node=ranks_per_node, placement=placement, grace_s=grace_s,
                         extra_env=extra_env)
        try:
            wait_ranks(rp, timeout_s=timeout_s, ranks_per_node=ranks_per_node)
        finally:
            rp.stop()
        return dict(placement.info)


def worker_module(package: str | None) -> str:
    """``experiments.worker`` when run from the repo root, ``zeropp.experiments.worker`` otherwise."""
    return f"{package or 'zeropp.experiments'}.worker"


__all__: Sequence[str] = ("RankFailure", "Placement", "in_torchrun", "launch", "local_placement",
                          "emulated_placement", "spawn_ranks", "wait_ranks", "worker_module")
