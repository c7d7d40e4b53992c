"""``train.profile=true``: a ``torch.profiler`` Chrome trace of chosen steps, per rank, and reading it back.

Writing (:class:`StepProfiler`, used by ``worker.py``): one ``torch.profiler.profile`` spans the
training loop with a schedule that records exactly the steps of ``train.profile_steps`` (each after
one warm-up step of the profiler, which starts it without recording, so start-up cost stays out
of the recorded step) and saves each as ``<run dir>/profile/rank<r>_step<n>.json`` through torch's
own ``export_chrome_trace``: valid Chrome trace JSON (``traceEvents``) that Perfetto and
``chrome://tracing`` open. CPU activities always, CUDA activities when the rank computes on a GPU;
every thread is recorded (``profile_all_threads``), so qgZ's cross-node hop, which runs on the comm
worker thread on CPU, is in the trace. Each step is the range ``zeropp/step/<n>``; zeropp's
collectives are ranges named after the communication plan (``zeropp.comm.ranges``).

Reading (:func:`read_step`): the ranges of one step of such a trace, parsed, with times relative
to the step's start: what ``python -m experiments.plan <run dir>`` draws beside the projection.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from zeropp.comm import ranges

PROFILE_DIR = "profile"
"""Sub-directory of the run directory holding the traces."""


def trace_path(run_dir: Path, rank: int, step: int) -> Path:
    """Where rank ``rank``'s trace of step ``step`` goes."""
    return Path(run_dir) / PROFILE_DIR / f"rank{rank}_step{step}.json"


def step_name(step: int) -> str:
    """The range of one training step (``zeropp/step/<n>``)."""
    return f"{ranges.PREFIX}/{ranges.STEP}/{step}"


class StepProfiler:
    """Records ``steps`` (1-based training steps) of the loop that starts after step ``start``.

    Use: ``with StepProfiler(...) as prof:`` around the loop, ``with prof.step(n):`` around
    step ``n``'s work. With no steps to record it does nothing (no profiler is created)."""

    def __init__(self, steps: tuple[int, ...], *, start: int, run_dir: Path, rank: int, device: torch.device) -> None:
        self.steps = frozenset(s for s in steps if s > start)
        self.start, self.run_dir, self.rank = start, Path(run_dir), rank
        self.written: list[Path] = []
        self._current = start
        self._prof: Optional[torch.profiler.profile] = None
        if not self.steps:
            return
        from torch._C._profiler import _ExperimentalConfig
        from torch.profiler import ProfilerActivity

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self._prof = torch.profiler.profile(
            activities=activities,
            schedule=self._action,
            on_trace_ready=self._save,
            # torch records only the starting thread's ranges unless told to record every thread
            experimental_config=_ExperimentalConfig(profile_all_threads=True),
        )

    def _action(self, k: int) -> Any:
        """The profiler's schedule: ``k`` counts its steps from 0 = training step ``start + 1``."""
        from torch.profiler import ProfilerAction

        s = self.start + 1 + k
        if s in self.steps:
            return ProfilerAction.RECORD_AND_SAVE
        return ProfilerAction.WARMUP if s + 1 in self.steps else ProfilerAction.NONE

    def _save(self, prof: torch.profiler.profile) -> None:
        path = trace_path(self.run_dir, self.rank, self._current)
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
        self.written.append(path)

    def __enter__(self) -> StepProfiler:
        if self._prof is not None:
            self._prof.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.stop()  # saves a step still recording (the last one)

    @contextlib.contextmanager
    def step(self, n: int) -> Iterator[None]:
        """Context of training step ``n``: its range; on a normal exit the profiler moves to the next
        step (saving ``n``'s trace when ``n`` is recorded)."""
        self._current = n  # the step a trace saved from here on holds
        with ranges.span(step_name(n)):
            yield
        if self._prof is not None:
            with warnings.catch_warnings():  # each step's trace is exported as it ends: nothing to keep
                warnings.filterwarnings("ignore", "Warning: Profiler clears events", UserWarning)
                self._prof.step()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Span:
    """One zeropp range of a trace."""

    name: str
    """The range's name (``zeropp.comm.ranges``)."""
    parsed: ranges.RangeName
    start_s: float
    """Start, seconds after the step's start."""
    dur_s: float
    tid: Any
    """The thread it ran on (the trace's ``tid``)."""
    main: bool
    """It ran on the thread that ran the step."""


def read_step(path: Path, step: Optional[int] = None) -> tuple[int, float, list[Span]]:
    """``(step, step duration s, spans)``: the zeropp ranges inside step ``step`` (default: the
    trace's only or last step) of the Chrome trace at ``path``, any thread. ValueError naming the
    file when it is not such a trace."""
    try:
        doc = json.loads(Path(path).read_text())
        events = doc["traceEvents"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"{path} is not a readable Chrome trace with traceEvents ({type(e).__name__}: {e}); "
            f"profile the run with train.profile=true"
        ) from None
    spans: list[tuple[dict[str, Any], ranges.RangeName]] = []
    for ev in events:
        if isinstance(ev, dict) and ev.get("ph") == "X" and isinstance(ev.get("name"), str):
            p = ranges.parse(ev["name"])
            if p is not None:
                spans.append((ev, p))
    steps = {p.step: ev for ev, p in spans if p.kind == ranges.STEP and p.step is not None}
    if not steps:
        raise ValueError(f"{path} has no zeropp/step/<n> range; it was not written by train.profile=true")
    if step is None:
        step = max(steps)
    if step not in steps:
        raise ValueError(f"{path} holds steps {sorted(steps)}, not step {step}; choose one of those")
    st = steps[step]
    t0, t1 = float(st["ts"]), float(st["ts"]) + float(st["dur"])
    out = [
        Span(
            name=e["name"],
            parsed=p,
            start_s=(float(e["ts"]) - t0) / 1e6,
            dur_s=float(e["dur"]) / 1e6,
            tid=e.get("tid"),
            main=e.get("tid") == st.get("tid"),
        )
        for e, p in spans
        if p.kind != ranges.STEP and t0 <= float(e["ts"]) <= t1
    ]
    return step, (t1 - t0) / 1e6, sorted(out, key=lambda s: s.start_s)


def busy_s(spans: list[Span], keep: Callable[[Span], bool]) -> float:
    """Seconds covered by the union of the kept spans' intervals (nested and concurrent ones once)."""
    iv = sorted((s.start_s, s.start_s + s.dur_s) for s in spans if keep(s))
    total, end = 0.0, float("-inf")
    for a, b in iv:
        if b > end:
            total += b - max(a, end)
            end = b
    return total
