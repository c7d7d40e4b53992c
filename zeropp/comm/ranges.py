"""zeropp's communication as named ranges of a ``torch.profiler`` trace.

Every collective call, qgZ hop, quantization and dequantization of ``zeropp.comm`` (and every
wait of the engine) runs inside a ``torch.profiler.record_function`` range while a profiler
records, so a trace (Perfetto, ``chrome://tracing``) shows where a step's time goes, named after
the communication plan's entries (``zeropp.runtime.plan.CommPlan.range_name``):

* ``zeropp/<kind>/<unit>/b<bucket>``: one call of a collective, bucket chunk ``<bucket>`` of
  ``<unit>``'s (``root``, ``block3``, ``block3.frozen``) collective of kind ``<kind>`` (a
  ``CommKind`` value);
* ``.../b<bucket>/intra``, ``.../b<bucket>/cross``: a quantized reduce-scatter's hop (qgZ's
  intra-node and cross-node all-to-all; a single hop is ``intra`` inside one node, else ``cross``);
* ``<call>/quantize``, ``<call>/dequantize``: the call's quantization and dequantization;
* ``zeropp/<kind>/<unit>/wait``: the engine blocked on ``<unit>``'s collective (all its buckets);
* ``zeropp/<kind>``: a call that names no unit (a user's call, the DDP / FSDP hooks), its hops and
  parts suffixed the same way;
* ``zeropp/control``: the engine's few-scalar all-reduces (loss, agreement checks);
* ``zeropp/step/<n>``: one training step of the runner (``experiments.runner.profiling``).

Ranges of asynchronous work sit on the thread that runs it: a qgZ cross hop on CPU runs on the
comm worker thread, so a profiler must record all threads (the runner sets
``_ExperimentalConfig(profile_all_threads=True)``) to see it; a call's dequantization runs where its
handle is waited.

Cost: ``record_function`` costs microseconds even with no profiler, and names are built per call,
so :func:`span` first reads :func:`enabled` (torch's own flag, set while a profiler records) and
is a ``nullcontext`` otherwise; callers build names only when :func:`enabled` says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import ContextManager, Optional

import torch

__all__ = ["HOPS", "PARTS", "PREFIX", "RangeName", "call_name", "call_range", "enabled", "parse", "span", "wait_name"]

PREFIX = "zeropp"
"""First segment of every range name."""
HOPS = ("intra", "cross")
"""qgZ hop segments."""
PARTS = ("quantize", "dequantize", "wait")
"""Last segments that mark a part of a call (or the wait for a unit's collective)."""
STEP = "step"
"""``zeropp/step/<n>``: a training step."""


def enabled() -> bool:
    """True while a torch profiler records (torch sets this module-level flag on its start and
    clears it on its stop; a scheduled profiler sets it only in its recording steps)."""
    return bool(torch.autograd.profiler._is_profiler_enabled)


def call_name(kind: str, unit: Optional[str] = None, bucket: Optional[int] = None, hop: Optional[str] = None) -> str:
    """``zeropp/<kind>[/<unit>][/b<bucket>][/<hop>]`` (module doc)."""
    name = f"{PREFIX}/{kind}"
    if unit:
        name += f"/{unit}"
    if bucket is not None:
        name += f"/b{bucket}"
    if hop:
        name += f"/{hop}"
    return name


def call_range(name: Optional[str], kind: str) -> Optional[str]:
    """A call's range name: ``name``, else ``zeropp/<kind>`` while a profiler records (else None:
    no name is built)."""
    return name if name is not None or not enabled() else call_name(kind)


def wait_name(kind: str, unit: str) -> str:
    """``zeropp/<kind>/<unit>/wait``: the engine blocked on ``unit``'s collective of ``kind``
    (``zeropp/<kind>/wait`` without a unit)."""
    return f"{call_name(kind, unit)}/wait"


def span(name: Optional[str], part: Optional[str] = None) -> ContextManager[object]:
    """A ``record_function`` range ``name`` (``name/part`` with ``part``) while a profiler records,
    else (or with ``name`` None) a no-op."""
    if name is None or not enabled():
        return contextlib.nullcontext()
    return torch.autograd.profiler.record_function(name if part is None else f"{name}/{part}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RangeName:
    """A parsed range name (:func:`parse`)."""

    kind: str
    """The ``CommKind`` value (``step`` for a training step)."""
    unit: Optional[str] = None
    """The unit (``root``, ``block3``, ``block3.frozen``); None for a call without one."""
    bucket: Optional[int] = None
    """The bucket chunk; None for a call without one, a wait or a step."""
    hop: Optional[str] = None
    """``intra`` or ``cross`` for a reduce-scatter's hop."""
    part: Optional[str] = None
    """``quantize``, ``dequantize`` or ``wait``; None for the call itself."""
    step: Optional[int] = None
    """The step of ``zeropp/step/<n>``."""

    @property
    def call(self) -> str:
        """The name of the call this range belongs to (itself, without its part)."""
        return call_name(self.kind, self.unit, self.bucket, self.hop)


def parse(name: str) -> Optional[RangeName]:
    """The parts of a range name of this module's grammar; None for any other name."""
    seg = name.split("/")
    if len(seg) < 2 or seg[0] != PREFIX or not seg[1]:
        return None
    kind, rest = seg[1], seg[2:]
    if kind == STEP:
        return RangeName(kind=kind, step=int(rest[0])) if len(rest) == 1 and rest[0].isdigit() else None
    part = rest.pop() if rest and rest[-1] in PARTS else None
    hop = rest.pop() if rest and rest[-1] in HOPS else None
    bucket = None
    if rest and rest[-1][:1] == "b" and rest[-1][1:].isdigit():
        bucket = int(rest.pop()[1:])
    if len(rest) > 1:
        return None
    return RangeName(kind=kind, unit=rest[0] if rest else None, bucket=bucket, hop=hop, part=part)
