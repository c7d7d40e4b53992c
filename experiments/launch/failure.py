"""What a failed world reports: which rank caused it, how it ended, and the tail of its error.

:func:`zeropp.experiments.launch.launch_world` first peeks every rank's exit status (:func:`exit_status`, a
``waitid(WNOWAIT)`` that leaves the child for torch to reap), so it knows which rank died *first*;
on a failure it stops every rank and then asks :func:`root_cause` for the :class:`RankFailure`.

The root cause, among the ranks that failed before the stop: one whose error is not a peer's
"connection closed" echo (:data:`PEER_ERRORS`: a rank whose peer died fails in its next
collective, often before the launcher sees the peer's exit), nor an error every rank raised alike
that names other ranks of the pool as where it arose (``zeropp.runtime.batch.on_ranks``: a
checkpoint file that fails its checksum on rank 0 makes every rank raise, and rank 1 may exit
first), seen first, not ended by a SIGTERM
(ours, from the stop), error written earliest. Its error text (:func:`rank_error`) is torch's
error file (``@record`` / function ranks) where the rank wrote one, else ``<log_dir>/rank<r>.err``,
else the tail of ``<log_dir>/rank<r>.log``.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Mapping, Sequence

from torch.distributed.elastic.multiprocessing import ProcessFailure

from zeropp.comm.shm_sync import PEER_EXITED
from zeropp.runtime.batch import origin_ranks

__all__: Sequence[str] = (
    "PEER_ERRORS",
    "RankFailure",
    "describe_exit",
    "exit_status",
    "rank_error",
    "root_cause",
    "shell_status",
)

PEER_ERRORS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Socket closed",
    "Timed out waiting",
    "ECONNRESET",
    "connectFullMesh",
    "Connection was likely closed",  # the TCPStore client's, when the rank hosting the store left (a roll call's key)
    PEER_EXITED,  # the shared-memory transport's: a peer's process ended during a collective (zero.transport=shm)
)
"""Errors a rank meets because a *peer* failed: such a rank is blamed only if no other one is."""


class RankFailure(RuntimeError):
    """A rank failed, the run timed out or was interrupted, or the placement cannot run the job."""

    def __init__(self, message: str, rank: int | None = None, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.exit_code = exit_code


class RunInterrupted(RankFailure):
    """The launching process itself was sent SIGINT / SIGTERM (Ctrl-C, ``timeout``, a scheduler's
    preemption): every rank was stopped. Not one job's failure: a caller running several jobs (a
    benchmark's rows, a sweep, a test) stops too instead of recording it and going on to the next."""


def shell_status(code: int | None) -> int:
    """A rank's exit code as a shell reports a process's status: 128 + N when it was killed by
    signal N (``code`` is then -N, as :func:`exit_status` and ``RankFailure.exit_code`` give it),
    the code itself otherwise, 1 when none is known."""
    if not code:
        return 1
    return 128 - code if code < 0 else code


def exit_status(pid: int) -> int | None:
    """Exit code of child ``pid`` if it has exited (``-signal`` if killed), without reaping it."""
    try:
        st = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # already reaped by torch: its RunProcsResult reports it
        return None
    if st is None:
        return None
    return -st.si_status if st.si_code in (os.CLD_KILLED, os.CLD_DUMPED) else st.si_status


def describe_exit(code: int) -> str:
    """``exited with code 1``, ``was killed by SIGKILL`` (``code``: as :func:`exit_status` gives it)."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _tail(path: Path, lines: int) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").rstrip().splitlines()[-lines:])
    return ""


def rank_error(rank: int, pid: int, code: int, error_file: str, log_dir: Path | None) -> tuple[str, float, bool]:
    """(error text, time it was written, whether the rank recorded it as an error) of a rank;
    ``("", inf, False)`` when it left nothing."""
    if os.path.isfile(error_file):
        with contextlib.suppress(Exception):  # a half-written file: fall through to the logs
            msg = ProcessFailure(local_rank=rank, pid=pid, exitcode=code, error_file=error_file).message
            text = msg.get("extraInfo", {}).get("py_callstack") or msg.get("message") if isinstance(msg, dict) else msg
            return "\n".join(str(text).rstrip().splitlines()[-60:]), os.stat(error_file).st_mtime, True
    for name, lines in ((f"rank{rank}.err", 60), (f"rank{rank}.log", 30)):
        path = (log_dir / name) if log_dir else None
        if path and (text := _tail(path, lines)):
            return text, path.stat().st_mtime, name.endswith(".err")
    return "", float("inf"), False


def root_cause(
    first: Mapping[int, int],
    codes: Mapping[int, int],
    *,
    pids: Mapping[int, int],
    error_files: Mapping[int, str],
    log_dir: Path | None,
    stopped_at: float,
    ranks_per_node: int | None,
) -> RankFailure:
    """The :class:`RankFailure` naming the root cause (module docstring) of a stopped world.

    ``first``: the ranks seen dead with a non-zero status before the stop, with it; ``codes``: every
    status seen; ``pids`` / ``error_files``: by rank; ``stopped_at``: when the launcher began
    stopping the world (``time.time()``): an error recorded before it is a candidate too.
    ``ranks_per_node`` only names the rank's node in the message."""
    errors = {r: rank_error(r, pids[r], codes.get(r, first.get(r, 1)), error_files[r], log_dir) for r in pids}
    pool = set(first) | {r for r, (_, t, recorded) in errors.items() if recorded and t < stopped_at}

    def echoes_another(r: int) -> bool:  # an error raised alike on every rank that names where it arose
        origins = origin_ranks(errors[r][0])
        return bool(origins) and r not in origins and any(o in pool for o in origins)

    rank = min(
        pool,
        key=lambda r: (
            any(e in errors[r][0] for e in PEER_ERRORS),
            echoes_another(r),
            r not in first,
            first.get(r) == -signal.SIGTERM,
            errors[r][1],
            r,
        ),
    )
    code = first.get(rank, codes.get(rank, 1))
    node = f" (node {rank // ranks_per_node})" if ranks_per_node else ""
    others = [r for r in pids if r != rank]
    return RankFailure(
        f"rank {rank}{node} {describe_exit(code)}; stopped ranks {others}.\n"
        f"--- rank {rank} error ---\n{errors[rank][0] or '(no error recorded; see its output)'}",
        rank=rank,
        exit_code=code,
    )
