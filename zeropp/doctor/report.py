"""The doctor's outputs: the pass / fail / skipped table (rich), the JSON report, and the exit
status (0 when nothing failed, skipped rows allowed; 1 otherwise)."""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path
from typing import Any, Sequence, TextIO

from rich.console import Console
from rich.table import Table

from ..output_files import check_output_file, json_file_is, write_output_file
from .result import CheckResult, Status

SCHEMA = 1
"""Version of the JSON report's layout (bumped when a key changes meaning)."""

_STYLE = {Status.PASS: "green", Status.FAIL: "bold red", Status.SKIP: "yellow"}


def exit_status(results: Sequence[CheckResult]) -> int:
    """0 when no check failed (skipped ones allowed), 1 otherwise."""
    return int(any(r.status is Status.FAIL for r in results))


def counts(results: Sequence[CheckResult]) -> dict[str, int]:
    return {s.value: sum(r.status is s for r in results) for s in Status}


def summary_line(results: Sequence[CheckResult]) -> str:
    c = counts(results)
    verdict = "FAILED" if exit_status(results) else "ok"
    skipped = [r.name for r in results if r.status is Status.SKIP]
    tail = f" (skipped: {', '.join(skipped)})" if skipped else ""
    return f"zeropp doctor: {verdict}: {c['pass']} passed, {c['fail']} failed, {c['skipped']} skipped{tail}"


def table(results: Sequence[CheckResult]) -> Table:
    t = Table(title="zeropp doctor", title_justify="left")
    t.add_column("check", no_wrap=True)
    t.add_column("status", no_wrap=True)
    t.add_column("s", justify="right", no_wrap=True)
    t.add_column("detail", overflow="fold")
    for r in results:
        t.add_row(r.name, f"[{_STYLE[r.status]}]{r.status.value}[/]", f"{r.seconds:.1f}", r.detail, end_section=False)
    return t


def print_report(results: Sequence[CheckResult], stream: TextIO | None = None) -> None:
    """The table and the summary line; plain text where ``stream`` is not a terminal (logs)."""
    stream = stream or sys.stdout
    console = Console(file=stream, width=None if stream.isatty() else 160, soft_wrap=False)
    console.print(table(results))
    console.print(summary_line(results), highlight=False, markup=False)


def to_json(results: Sequence[CheckResult], seconds: float) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "exit_status": exit_status(results),
        "counts": counts(results),
        "seconds": round(seconds, 2),
        "checks": [r.to_json() for r in results],
    }


def is_report(doc: Any) -> bool:
    """Whether ``doc`` (parsed JSON) has the shape of a report :func:`to_json` made."""
    return isinstance(doc, dict) and doc.get("schema") == SCHEMA and isinstance(doc.get("checks"), list)


def check_json_path(path: Path) -> None:
    """Refuse, before any check runs, a report path that cannot be written (a directory, a parent
    that is missing or refuses a new file) or that holds a file other than an earlier doctor report,
    which the report must not replace. Raises ValueError saying what to change
    (:func:`zeropp.output_files.check_output_file`)."""
    check_output_file(path, "--json", ours=lambda p: json_file_is(p, is_report))


def write_json(path: Path, report: dict[str, Any]) -> None:
    """Write the report atomically and durably (``zeropp.output_files.write_output_file``: a reader
    never sees half a report, and a failed write leaves ``path`` as it was)."""
    write_output_file(path, json.dumps(report, indent=2, default=str) + "\n")
