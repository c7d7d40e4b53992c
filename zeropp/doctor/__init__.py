"""``python -m zeropp.doctor``: the first command on a new machine or cluster.

Checks the versions (Python, torch, Triton, CUDA runtime, NCCL, driver, zeropp), the CPU and the
GPUs with their topology, the native CPU kernel build and, on CUDA, the Triton kernels (each bit
for bit against ``kernels/reference.py``) with their GB/s against a device copy, and whether
process groups initialize and compute the right collectives (a gloo world always, an NCCL world
of every local GPU on CUDA, plain and through zeropp's quantized collectives). Prints a
pass / fail / skipped table, optionally writes a JSON report, and exits 0 when nothing failed.
Without a CUDA device every GPU row is "skipped: no CUDA device".

Each check is a function ``fn(DoctorOptions) -> CheckResult`` (``CHECKS``), run by
:func:`run_checks` inside its time limit, so nothing here can hang.
"""

from __future__ import annotations

import sys
from typing import Callable, Optional, Sequence

from .kernel_checks import check_bandwidth, check_cpu_adamw, check_native_cpu, check_triton
from .result import Check, CheckResult, DoctorOptions, Status, run_check
from .system import check_cpu, check_cuda, check_gpus, check_versions
from .world import check_gloo, check_nccl

CHECKS: tuple[tuple[str, Check], ...] = (
    ("versions", check_versions),
    ("cpu", check_cpu),
    ("cuda", check_cuda),
    ("gpus", check_gpus),
    ("native CPU kernels", check_native_cpu),
    ("CPU AdamW", check_cpu_adamw),
    ("Triton kernels", check_triton),
    ("kernel GB/s", check_bandwidth),
    ("gloo world", check_gloo),
    ("nccl world", check_nccl),
)
"""Every check, in the order of the report."""

WORLD_CHECKS = frozenset({"gloo world", "nccl world"})
"""Checks that run their own child processes under ``world_timeout_s`` (their thread gets that
plus :data:`WORLD_MARGIN_S`, for killing and reading back the ranks)."""

WORLD_MARGIN_S = 30.0


def run_checks(
    options: DoctorOptions,
    checks: Sequence[tuple[str, Check]] = CHECKS,
    progress: Optional[Callable[[CheckResult], None]] = None,
) -> list[CheckResult]:
    """Run ``checks`` in order, each in its time limit; ``progress`` sees each row as it ends."""
    results = []
    for name, fn in checks:
        limit = options.world_timeout_s + WORLD_MARGIN_S if name in WORLD_CHECKS else options.check_timeout_s
        r = run_check(name, fn, options, limit)
        results.append(r)
        if progress is not None:
            progress(r)
    return results


def print_progress(r: CheckResult) -> None:
    print(f"doctor: {r.name}: {r.status.value} ({r.seconds:.1f} s)", file=sys.stderr, flush=True)


__all__ = ["CHECKS", "CheckResult", "DoctorOptions", "Status", "print_progress", "run_check", "run_checks"]
