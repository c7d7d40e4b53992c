"""Shared pieces of the doctor's tests: crafted checks (passing, failing, skipped, raising, hung)
to inject into ``run_checks`` / the command line, and crafted rank programs for the worlds."""

from __future__ import annotations

import threading

from zeropp.doctor.result import CheckResult, DoctorOptions, failed, passed, skipped


def ok_check(options: DoctorOptions) -> CheckResult:
    return passed("ok", "fine", answer=42)


def failing_check(options: DoctorOptions) -> CheckResult:
    return failed("broken", "it broke; change this")


def skipped_check(options: DoctorOptions) -> CheckResult:
    return skipped("gpu thing", "skipped: no CUDA device")


def raising_check(options: DoctorOptions) -> CheckResult:
    return CheckResult(name="x", status=1 // 0, detail="")  # type: ignore[arg-type]


def hung_check(options: DoctorOptions) -> CheckResult:
    threading.Event().wait()  # never set: a check that never returns
    raise AssertionError("unreachable")


def rank_program(body: str) -> list[str]:
    """A rank program for ``world.launch(cmd=...)``: Python ``body`` with ``emit(event, **kw)``
    (the JSON line a real rank prints), ``rank`` and ``time`` defined; no torch import, so it starts
    in a fraction of a second."""
    prelude = (
        "import json, os, sys, time\n"
        "rank = int(os.environ['RANK'])\n"
        "def emit(event, **kw):\n"
        "    print(json.dumps(dict(kw, event=event)), flush=True)\n"
    )
    import sys

    return [sys.executable, "-c", prelude + body]
