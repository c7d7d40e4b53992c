"""Whether process groups initialize here, and whether collectives on them are right: a world of
local processes on gloo (always) and on NCCL (one rank per local GPU, when CUDA is present).

Each rank is a child process (``python -m zeropp.doctor.rank``, ``rank.py``) so that a hung rendezvous, a
crashed backend or a deadlocked collective can be killed: the parent gives the world
``options.world_timeout_s`` seconds, then kills every rank still alive and reports which phase
hung, with what to check. The ranks rendezvous through torch's TCPStore (``env://``) on
``options.master_addr`` and a free port; every rank destroys its process group before it exits.

What each rank checks is in ``rank.py``; each prints JSON lines that the parent reads from
files (no pipe can fill up and block a rank).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from typing import Any, Optional

import torch

from . import system
from .result import NO_CUDA, CheckResult, DoctorOptions, failed, passed, skipped

FAILED_RANK_GRACE_S = 5.0
"""After one rank failed, how long the others get to finish before they are killed (they may wait
in a collective for the failed one forever)."""

HINT = "check: the firewall, the address (--master-addr / MASTER_ADDR), GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME"


def address_problem(addr: str) -> Optional[str]:
    """Why the doctor's local worlds cannot rendezvous on ``addr``, or None: every rank runs on this
    host and meets on ``addr``, so it must resolve and be one of this host's addresses (one a
    socket can bind). Otherwise each rank waits out ``--world-timeout`` and the row blamed a hung
    init; this says so before any check runs."""
    try:
        infos = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        return f"--master-addr {addr} does not resolve ({why}); give this host's address or name (default 127.0.0.1)"
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((sockaddr[0], 0))
            return None
        except OSError:
            continue
    found = ", ".join(sorted({str(i[4][0]) for i in infos}))
    return (
        f"--master-addr {addr} ({found}) is not an address of this host: the doctor's worlds start their ranks "
        "here and they meet on it; give one of this host's addresses (default 127.0.0.1)"
    )


def free_port(addr: str) -> int:
    """A TCP port free on ``addr`` at this moment (the OS picks it); on an address this host does
    not own, one free on all interfaces."""
    for host in (addr, ""):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                return int(s.getsockname()[1])
        except OSError:
            continue
    raise OSError(f"no free TCP port on {addr!r}")


class _Ranks:
    """Every rank process of the doctor's worlds still running. The checks run in threads of their
    own (``result.run_check``), where the exception a signal raises in the main thread never
    arrives, so :func:`launch`'s own clean-up cannot stop a world's ranks when the doctor is
    interrupted; :func:`stop_ranks`, called from the main thread, does."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._procs: set[subprocess.Popen] = set()
        self._refused: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
        """The threads that were running when :meth:`stop` was called (an interrupted doctor's check
        threads): they start no rank. Other threads, a later doctor run in this process among them
        (a test session's), still may."""

    def start(self, cmd: list[str], **kw: Any) -> subprocess.Popen:
        """Start a rank, unless :meth:`stop` was called (an interrupted doctor starts none)."""
        with self._lock:
            if threading.current_thread() in self._refused:
                raise RuntimeError("the doctor was interrupted: no rank is started")
            p = subprocess.Popen(cmd, **kw)
            self._procs.add(p)
            return p

    def forget(self, p: subprocess.Popen) -> None:
        with self._lock:
            self._procs.discard(p)

    def stop(self) -> None:
        """Kill every rank still running and reap it; no thread running now starts one after this."""
        with self._lock:
            me = threading.current_thread()
            self._refused.update(t for t in threading.enumerate() if t is not me)
            procs = list(self._procs)
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()


_ranks = _Ranks()


def stop_ranks() -> None:
    """Kill every rank of the doctor's worlds still running, and start no more: for an interrupted
    doctor, whose world check still runs in its own thread."""
    _ranks.stop()


def _rank_cmd() -> list[str]:
    return [sys.executable, "-m", "zeropp.doctor.rank"]


def launch(backend: str, nranks: int, options: DoctorOptions, cmd: Optional[list[str]] = None) -> dict[str, Any]:
    """Run the world; return ``{"ranks": [...], "timed_out": bool, "port": int}``, each rank's entry
    with its JSON events, exit status, stderr's tail and whether it was killed.
    ``cmd``: the rank program (tests substitute a crafted one)."""
    port = free_port(options.master_addr)
    deadline = time.monotonic() + options.world_timeout_s
    procs: list[subprocess.Popen] = []
    with contextlib.ExitStack() as files:
        outs = [files.enter_context(tempfile.TemporaryFile("w+")) for _ in range(nranks)]
        errs = [files.enter_context(tempfile.TemporaryFile("w+")) for _ in range(nranks)]
        timed_out = False
        try:
            for rank in range(nranks):
                env = dict(
                    os.environ,
                    RANK=str(rank),
                    LOCAL_RANK=str(rank),
                    WORLD_SIZE=str(nranks),
                    MASTER_ADDR=options.master_addr,
                    MASTER_PORT=str(port),
                    ZEROPP_DOCTOR_BACKEND=backend,
                    ZEROPP_DOCTOR_TIMEOUT_S=str(options.world_timeout_s),
                    OMP_NUM_THREADS="1",
                )
                procs.append(
                    _ranks.start(
                        cmd or _rank_cmd(), stdout=outs[rank], stderr=errs[rank], stdin=subprocess.DEVNULL, env=env
                    )
                )
            timed_out = _wait(procs, deadline)
        finally:
            killed = [p.poll() is None for p in procs]
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
                _ranks.forget(p)
        ranks = [
            dict(_read_rank(rank, p, out, err), killed=k)
            for rank, (p, out, err, k) in enumerate(zip(procs, outs, errs, killed))
        ]
    return {"ranks": ranks, "timed_out": timed_out, "port": port}


def _wait(procs: list[subprocess.Popen], deadline: float) -> bool:
    """Wait for every rank to exit; stop waiting at ``deadline`` (returns True: timed out) or
    :data:`FAILED_RANK_GRACE_S` after the first rank failed (returns False)."""
    first_fail = None
    while any([p.poll() is None for p in procs]):  # a list: every rank is polled, so each exit is seen
        now = time.monotonic()
        if now > deadline:
            return True
        if first_fail is None and any(p.returncode not in (None, 0) for p in procs):
            first_fail = now
        if first_fail is not None and now - first_fail > FAILED_RANK_GRACE_S:
            return False
        time.sleep(0.05)
    return False


def _read_rank(rank: int, p: subprocess.Popen, out: Any, err: Any) -> dict[str, Any]:
    """A finished rank's events (its JSON lines; other output is ignored) and its stderr's tail."""
    out.seek(0)
    err.seek(0)
    events = []
    for line in out.read().splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue  # a library's stray print
        if isinstance(ev, dict) and "event" in ev:
            events.append(ev)
    return {"rank": rank, "returncode": p.returncode, "events": events, "stderr_tail": err.read()[-2000:]}


def _phase(rank: dict[str, Any]) -> str:
    done = {e["event"] for e in rank["events"]}
    return (
        "finished" if "done" in done else "collectives" if "init" in done else "init" if "started" in done else "start"
    )


def verdict(name: str, backend: str, nranks: int, options: DoctorOptions, world: dict[str, Any]) -> CheckResult:
    """The row for a finished (or killed) world: pass only when every rank reported every check
    good; otherwise what failed, on which rank, and what to check."""
    ranks = world["ranks"]
    where = f"{backend}, {nranks} rank(s) on {options.master_addr}:{world['port']}"
    data = {"backend": backend, "world_size": nranks, "master_addr": options.master_addr, **world}
    for r in ranks:
        err = next((e for e in r["events"] if e["event"] == "error"), None)
        if err is not None:
            return failed(
                name, f"rank {r['rank']} failed in {err['phase']} ({where}): {err['error'][:300]}; {HINT}", **data
            )
    if world["timed_out"] or any(r["returncode"] != 0 for r in ranks):
        stuck = [r for r in ranks if _phase(r) != "finished"]
        phase = min((_phase(r) for r in stuck), key=["start", "init", "collectives", "finished"].index, default="?")
        if world["timed_out"]:
            what = {
                "start": "the ranks did not start (importing torch)",
                "init": "process-group init hung",
                "collectives": "a collective hung",
            }.get(phase, "the world hung")
            return failed(
                name, f"{what}: not done in {options.world_timeout_s:g} s ({where}), ranks killed; {HINT}", **data
            )
        # the rank that ended by itself first (the others were killed after it), else the first stuck one
        r = next((r for r in ranks if r["returncode"] != 0 and not r["killed"]), stuck[0] if stuck else ranks[0])
        tail = (r["stderr_tail"].strip().splitlines() or ["no output"])[-1]
        return failed(
            name,
            f"rank {r['rank']} exited with {r['returncode']} during {_phase(r)} ({where}): {tail[:300]}; {HINT}",
            **data,
        )
    results = [next(e for e in r["events"] if e["event"] == "done")["checks"] for r in ranks]
    bad = [f"rank {i} {c}: {v['detail']}" for i, res in enumerate(results) for c, v in res.items() if not v["ok"]]
    if bad:
        return failed(name, f"wrong results ({where}): {bad[0]}", mismatches=bad, **data)
    worst = max(
        (v.get("error", 0.0) / v["bound"] for res in results for v in res.values() if v.get("bound")), default=0.0
    )
    init_s = max(next(e for e in r["events"] if e["event"] == "init")["seconds"] for r in ranks)
    return passed(
        name,
        f"{nranks} rank(s) initialize in {init_s:.1f} s; all-gather and reduce-scatter exact; INT8 quantized ones "
        f"within their error bound (worst {100 * worst:.0f}% of it)",
        **data,
    )


def check_gloo(options: DoctorOptions) -> CheckResult:
    """A gloo world of ``options.gloo_ranks`` local processes initializes and its collectives are right."""
    world = launch("gloo", options.gloo_ranks, options)
    return verdict("gloo world", "gloo", options.gloo_ranks, options, world)


def check_nccl(options: DoctorOptions) -> CheckResult:
    """An NCCL world of every local GPU initializes and its collectives are right."""
    if not system.cuda_usable():
        return skipped("nccl world", NO_CUDA)
    if not torch.distributed.is_nccl_available():
        return failed("nccl world", f"torch {torch.__version__} is built without NCCL: install a CUDA build of torch")
    n = torch.cuda.device_count()
    return verdict("nccl world", "nccl", n, options, launch("nccl", n, options))
