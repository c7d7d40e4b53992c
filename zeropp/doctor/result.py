"""What one check returns (:class:`CheckResult`), the options of a run (:class:`DoctorOptions`)
and how a check runs inside its time limit (:func:`run_check`).

Each check is a plain function ``fn(options) -> CheckResult`` so that the command line, the JSON
report and the tests compose the same pieces. A check that raises becomes a failed row with the
exception in its detail; one that outlives its time limit becomes a failed row saying so, and the
run goes on (a hung GPU call or compiler cannot hang the doctor).
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional


class Status(str, enum.Enum):
    """A check's outcome. Skipped rows (no CUDA device, ``--quick``) do not fail the run."""

    PASS = "pass"
    FAIL = "fail"
    SKIP = "skipped"


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckResult:
    """One row of the report."""

    name: str
    """Short name of the check (the table's first column, the JSON key ``name``)."""
    status: Status
    """pass / fail / skipped."""
    detail: str
    """One line for the reader: what was found, or what failed and what to change."""
    seconds: float = 0.0
    """Wall time the check took (filled in by :func:`run_check`)."""
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Machine-readable findings (versions, device properties, GB/s, errors), JSON-serialisable."""

    def __post_init__(self) -> None:
        if not isinstance(self.status, Status):
            raise TypeError(f"status must be a Status, got {self.status!r}")
        if not self.name or "\n" in self.detail:
            raise ValueError(f"a check needs a name and a one-line detail, got {self.name!r}: {self.detail!r}")

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status.value,
            "detail": self.detail,
            "seconds": round(self.seconds, 3),
            "data": self.data,
        }


def passed(name: str, detail: str, **data: Any) -> CheckResult:
    return CheckResult(name=name, status=Status.PASS, detail=detail, data=data)


def failed(name: str, detail: str, **data: Any) -> CheckResult:
    return CheckResult(name=name, status=Status.FAIL, detail=detail, data=data)


def skipped(name: str, detail: str, **data: Any) -> CheckResult:
    return CheckResult(name=name, status=Status.SKIP, detail=detail, data=data)


NO_CUDA = "skipped: no CUDA device (torch.cuda.is_available() is False)"
"""The detail of every GPU row on a machine without a usable CUDA device."""


MAX_SECONDS = 1e9
"""The longest time limit (about 31 years): a thread's join and a deadline take at most
``threading.TIMEOUT_MAX`` (about 9.2e9 s), so a larger value (inf, a slip like 1e300) would crash
the doctor instead of limiting it."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DoctorOptions:
    """What ``python -m zeropp.doctor`` was asked to do."""

    quick: bool = False
    """Skip the bandwidth measurements (the GB/s rows report "skipped: --quick")."""
    json_path: Optional[Path] = None
    """Where to write the JSON report (None: no file)."""
    check_timeout_s: float = 120.0
    """The longest one in-process check may run before it is reported as failed (hung)."""
    world_timeout_s: float = 60.0
    """The longest a process-group check (its ranks' start, init and collectives) may run before
    its ranks are killed and it is reported as failed."""
    master_addr: str = "127.0.0.1"
    """The address the local worlds rendezvous on: loopback by default; this host's address on
    the cluster network checks that interface (and its firewall) instead."""
    gloo_ranks: int = 2
    """Ranks of the gloo world (local processes)."""

    def __post_init__(self) -> None:
        for name in ("check_timeout_s", "world_timeout_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v <= MAX_SECONDS:
                raise ValueError(f"{name} must be a number of seconds > 0 and <= {MAX_SECONDS:g}, got {v!r}")
        if not isinstance(self.master_addr, str) or not self.master_addr.strip():
            raise ValueError(f"master_addr must be a host name or address, got {self.master_addr!r}")
        if not isinstance(self.gloo_ranks, int) or isinstance(self.gloo_ranks, bool) or not 1 <= self.gloo_ranks <= 16:
            raise ValueError(f"gloo_ranks must be an integer from 1 to 16, got {self.gloo_ranks!r}")


Check = Callable[[DoctorOptions], CheckResult]


def run_check(name: str, fn: Check, options: DoctorOptions, limit_s: Optional[float] = None) -> CheckResult:
    """``fn(options)`` with its wall time, in a daemon thread given ``limit_s`` seconds (default
    ``options.check_timeout_s``). An exception is a failed row naming it; a check still running
    at the limit is a failed row (its thread is left behind, as a hung library call cannot be
    interrupted from Python, and it cannot keep the process alive)."""
    limit = options.check_timeout_s if limit_s is None else limit_s
    box: list[CheckResult] = []
    t0 = time.perf_counter()

    def body() -> None:
        try:
            box.append(fn(options))
        except BaseException as err:  # the row reports it; nothing propagates out of a check
            tb = traceback.extract_tb(err.__traceback__)
            where = f" at {Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else ""
            msg = str(err).strip().splitlines()[0] if str(err).strip() else ""
            box.append(failed(name, f"raised {type(err).__name__}{where}: {msg}"[:500]))

    thread = threading.Thread(target=body, name=f"doctor-{name}", daemon=True)
    thread.start()
    thread.join(limit)
    seconds = time.perf_counter() - t0
    if not box:
        return dataclasses.replace(
            failed(
                name, f"did not finish in {limit:g} s (hung?); rerun with a larger --check-timeout to see if it ends"
            ),
            seconds=seconds,
        )
    return dataclasses.replace(box[0], name=box[0].name or name, seconds=seconds)
