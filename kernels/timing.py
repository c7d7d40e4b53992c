"""One timer for the kernels' benchmarks and checks: the median seconds of a call, by CUDA events
on a CUDA device and by ``time.perf_counter`` elsewhere. It lives at the lowest floor so that the
library (``zeropp.doctor``) and the harness (``experiments.bench``, ``experiments.studies``) share
it; torch offers ``torch.utils.benchmark.Timer``, but that reports means over adaptive run counts
and synchronises the whole device rather than timing one call on the current stream.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_seconds(
    fn: Callable[[], object], *, device: torch.device | str | None = None, warmup: int = 1, iters: int = 20
) -> float:
    """Median seconds of one call of ``fn`` over ``iters`` timed calls after ``warmup`` untimed
    ones. ``device`` CUDA: CUDA events around each call on the current stream (the queue drained
    first); anything else (``None``: the CPU): wall time with ``time.perf_counter``."""
    if iters < 1 or warmup < 0:
        raise ValueError(f"median_seconds: iters must be >= 1 and warmup >= 0, got iters={iters}, warmup={warmup}")
    for _ in range(warmup):
        fn()
    times = []
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)
