"""``kernels/timing.median_seconds``, the one timer of the benchmarks and the doctor: the median of
the timed calls after the untimed warm-up ones, on a fake clock so that the figures are exact."""

from __future__ import annotations

import pytest

from zeropp.kernels import timing


def test_median_of_the_timed_calls_after_the_warmup(monkeypatch: pytest.MonkeyPatch) -> None:
    durations = iter([5.0, 1.0, 9.0, 2.0, 3.0])  # seconds of the 5 timed calls, in order
    clock = {"now": 100.0}
    calls = []

    def fn() -> None:
        calls.append(clock["now"])
        if len(calls) > 2:  # the 2 warm-up calls take no (fake) time
            clock["now"] += next(durations)

    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock["now"])
    assert timing.median_seconds(fn, warmup=2, iters=5) == 3.0
    assert len(calls) == 7


def test_a_cpu_device_is_timed_by_wall_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    ticks = iter([0.0, 0.5, 1.0, 1.25, 2.0, 2.75])
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(ticks))
    assert timing.median_seconds(lambda: None, device="cpu", warmup=0, iters=3) == 0.5


@pytest.mark.parametrize("warmup, iters", [(1, 0), (-1, 3)])
def test_no_timed_call_is_refused(warmup: int, iters: int) -> None:
    with pytest.raises(ValueError, match="iters must be >= 1 and warmup >= 0"):
        timing.median_seconds(lambda: None, warmup=warmup, iters=iters)
