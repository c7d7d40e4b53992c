"""Memory: what each rank holds, by phase and by tier, and what ZeRO's formulas say it should hold.

Two views of the same bytes:

* ``measure_memory`` (the flat view of ``ZeroEngine.memory_report``) reads the sizes of the model
  state the engine keeps between uses (transient gathered blocks and in-flight gradient buckets
  are not model state and are not counted).
* :class:`MemorySnapshot` (``ZeroEngine.memory_phases``) splits a rank's bytes by **tier**
  (``device``: the model's device, ``host``: CPU memory the runtime moved state to, ``disk``:
  swap files under ``nvme_path``) and **category** (params, grads, optimizer, activations,
  buffers), recorded after model creation, optimizer creation, forward, backward and the step
  (:data:`PHASES` says what each holds), with the peak of the phase. On GPUs the peak and the
  allocator's view come from ``torch.cuda.memory_stats`` (the peak counter is reset at every
  phase boundary); on CPU ranks the runtime's own accounting is the figure, next to the process
  RSS and its lifetime peak (``getrusage``, which cannot be reset: it is the peak so far, not the
  phase's).

A component that holds state somewhere other than the engine's flat units reports it through
``memory_by_tier() -> {"device"|"host"|"disk": bytes}`` (the optimizer-state holder, an
offloaded parameter store, the activation tracker) or ``nbytes`` (a communication buffer pool,
counted on the device); the engine registers it under a category with ``track_memory``.

``expected_memory`` is background.md section 1's table with the byte widths as parameters, plus
hpZ's secondary copy (Ψ·p / hpz_size):

| stage | params   | grads    | optimizer (fp32 master + m + v) |
|-------|----------|----------|---------------------------------|
| 0     | pΨ       | gΨ       | 12Ψ                             |
| 1     | pΨ       | gΨ       | 12Ψ/N                           |
| 2     | pΨ       | gΨ/N     | 12Ψ/N                           |
| 3     | pΨ/N     | gΨ/N     | 12Ψ/N                           |

With bf16 (p = g = 2) the rows are 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N and 16Ψ/N. ``expected_by_tier``
places those bytes on tiers the way ZeRO-Offload / ZeRO-Infinity (and DeepSpeed's
``estimate_zero{2,3}_model_states_mem_needs``) do: ``offload_optimizer`` moves the 12Ψ/N of
optimizer state (plus, for `cpu`, the fp32 gradient copy the host step reads, 4Ψ/N) to host or disk;
``offload_param`` (stage 3) moves the pΨ/N parameter shard. The compute-dtype gradient shard the
reduce-scatter lands in stays on the device.
"""

from __future__ import annotations

import os
import resource
import sys
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch

from zeropp.comm.codecs import codec_for
from zeropp.comm.spec import QuantSpec

from . import frozen as fz
from .choices import MemoryTier, OffloadTier
from .partition import FlatUnit
from .plan_kinds import group_size_of
from .wrapped import GradInEngine

KEYS = ("params", "grads", "optimizer", "hpz_secondary", "total")
"""Keys of the flat model-state report (``ZeroEngine.memory_report``)."""
TIERS = MemoryTier.values()
"""Where bytes live: the model's device, host (CPU) memory, swap files on disk."""
CATEGORIES = ("params", "grads", "optimizer", "activations", "buffers")
"""What the bytes are (hpZ secondary copies count as params)."""
MODEL_STATE = ("params", "grads", "optimizer")
"""The categories ZeRO's formulas cover."""
PHASES = ("model_creation", "optimizer_creation", "forward", "backward", "step")
"""When the engine records a snapshot, and what it holds then:

- ``model_creation`` (inside ``ZeroEngine.__init__``, before the optimizer): the parameters as
  the stage keeps them (full compute-dtype replicas at stages 0-2, this rank's 1/N shard at stage
  3, on ``offload_param``'s tier), the stages 2-3 gradient-shard buffers (allocated up front,
  zero) and the constant communication buffer pool;
- ``optimizer_creation`` (end of ``__init__``): plus the whole optimizer state on its tier: the
  fp32 master (unless it is the parameter itself, fp32 without offload) and Adam's two moments.
  The engine allocates them here, at once; ``torch.optim.Adam`` allocates its moments lazily at
  the first ``step()``, so a plain-torch study shows them only in its step phase;
- ``forward`` (after the last micro-batch's forward): plus the activations saved for backward;
- ``backward`` (after its backward): the activations are freed and the gradients exist (full
  ones at stages 0-1, the reduced shard at stages 2-3): all of ZeRO's model state, the moment
  :func:`expected_by_tier` describes;
- ``step`` (after the optimizer step, parameters refreshed): the full gradients of stages 0-1
  are consumed; the stages 2-3 gradient shard stays allocated for the next step."""
OFFLOAD_CHOICES = OffloadTier.values()
OFFLOAD_TIER = {t.value: t.memory_tier.value for t in OffloadTier}
"""``offload_optimizer`` / ``offload_param`` value -> the tier that state lives on."""


def _nbytes(t) -> int:
    return 0 if t is None or isinstance(t, GradInEngine) else t.numel() * t.element_size()  # (the latter: no storage)


def measure_memory(units: Iterable[FlatUnit], optimizer_bytes: int) -> dict[str, int]:
    """Bytes held by this rank now in ``units``' buffers plus ``optimizer_bytes`` of optimizer
    state. Call at the end of backward for the step's peak model state (gradients and hpZ copies
    exist then). Frozen units (stage 3) count their stored shard under ``params``: the quantized
    wire row with ``quantize_frozen=int8|int4``, else the compute-dtype shard (not the host copy of
    rounded originals, which :func:`account` puts on the host tier)."""
    params = grads = hpz = 0
    for u in units:
        if u.kind == "frozen":  # stage-3 frozen shard as stored (quantized wire row or compute dtype)
            params += fz.held_bytes(u)
        else:
            params += _nbytes(u.param_shard) if u.kind == "sharded" else _nbytes(u.flat)
        if u.grad_shard is not None:
            grads += _nbytes(u.grad_shard)
        else:  # full gradients held by autograd until the final reduction (stages 0/1, replicated units)
            grads += sum(_nbytes(p.grad) for p in u.params)
        hpz += _nbytes(u.secondary)
    opt = optimizer_bytes
    return {
        "params": params,
        "grads": grads,
        "optimizer": opt,
        "hpz_secondary": hpz,
        "total": params + grads + opt + hpz,
    }


# ---------------------------------------------------------------------- formulas
def hpz_bytes_per_param(weights: QuantSpec | None, param_bytes: int, *, weight_diff: bool = False) -> float:
    """Bytes per parameter of hpZ's secondary copy: with qwZ (and no weight differences, which
    refresh full-precision copies) the gathered wire rows are kept (``gathers.UnitGathers.keeps_rows``):
    the codec's row bytes per element (INT8 at 512 per scale: 1 + 4/512); else ``param_bytes``."""
    if weights is None or weight_diff:
        return float(param_bytes)
    n = 1 << 20  # a long row: the per-row rounding of the last group does not show
    return codec_for(weights).wire_bytes(n, weights.bits, group_size_of(weights, weights=True)) / n


def expected_memory(
    stage: int,
    num_params: int,
    world_size: int,
    *,
    param_bytes: int = 2,
    grad_bytes: int | None = None,
    hpz_size: int | None = None,
    hpz_bytes: float | None = None,
    shared_master: bool = False,
) -> dict[str, float]:
    """The table above for ``num_params`` (Ψ) parameters on ``world_size`` (N) ranks, all tiers
    together. ``shared_master``: the fp32 master shard is the parameter (shard) itself (fp32
    compute without a second copy), so the optimizer holds only the two moments (8Ψ/N).
    ``hpz_bytes``: bytes per parameter of hpZ's secondary copy (default ``param_bytes``; with qwZ it
    is kept as wire rows: :func:`hpz_bytes_per_param`)."""
    g = param_bytes if grad_bytes is None else grad_bytes
    n, psi = world_size, num_params
    params = psi * param_bytes / (n if stage == 3 else 1)
    grads = psi * g / (n if stage >= 2 else 1)
    opt = (8 if shared_master else 12) * psi / (n if stage >= 1 else 1)
    hpz = psi * (param_bytes if hpz_bytes is None else hpz_bytes) / hpz_size if hpz_size else 0.0
    return {
        "params": params,
        "grads": grads,
        "optimizer": opt,
        "hpz_secondary": hpz,
        "total": params + grads + opt + hpz,
    }


def _check_offload(stage: int, offload_optimizer: str, offload_param: str) -> None:
    for name, v in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)):
        if v not in OFFLOAD_CHOICES:
            raise ValueError(f"{name} must be one of {OFFLOAD_CHOICES}, got {v!r}")
    if offload_optimizer != "none" and stage == 0:
        raise ValueError(f"offload_optimizer={offload_optimizer!r} needs stage >= 1 (stage 0 has no optimizer shard)")
    if offload_param != "none" and stage != 3:
        raise ValueError(f"offload_param={offload_param!r} needs stage 3 (got stage {stage})")


def expected_by_tier(
    stage: int,
    num_params: int,
    world_size: int,
    *,
    param_bytes: int = 2,
    grad_bytes: int | None = None,
    hpz_size: int | None = None,
    hpz_bytes: float | None = None,
    offload_optimizer: str = "none",
    offload_param: str = "none",
    offload_grad_bytes: int = 4,
    shared_master: bool = False,
) -> dict[str, dict[str, float]]:
    """ZeRO's model-state bytes per rank as ``{tier: {"params", "grads", "optimizer": bytes}}``.

    ``offload_optimizer`` (``cpu``/``nvme``) puts the optimizer's 12Ψ/N (fp32 master + m + v) on
    that tier; ``cpu`` adds ``offload_grad_bytes``·Ψ/N for the fp32 gradient copy the host step
    reads (counted as optimizer state: it belongs to the offloaded optimizer), while ``nvme``
    streams the device's gradient shard through the swap buffers and keeps no copy. ``offload_param`` (stage 3) puts the pΨ/N parameter shard there;
    hpZ's secondary copy and the gradient shard stay on the device. ``shared_master`` applies
    only while the optimizer and the parameters stay together on the device (no offload of either:
    the engine aliases the master to the parameter shard only then)."""
    _check_offload(stage, offload_optimizer, offload_param)
    shared = shared_master and offload_optimizer == "none" and offload_param == "none"
    flat = expected_memory(
        stage,
        num_params,
        world_size,
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        hpz_size=hpz_size,
        hpz_bytes=hpz_bytes,
        shared_master=shared,
    )
    out = {t: {c: 0.0 for c in MODEL_STATE} for t in TIERS}
    tier = OFFLOAD_TIER
    out[tier[offload_param]]["params"] += flat["params"]
    out["device"]["params"] += flat["hpz_secondary"]
    out["device"]["grads"] += flat["grads"]
    opt_tier = tier[offload_optimizer]
    out[opt_tier]["optimizer"] += flat["optimizer"]
    if offload_optimizer == "cpu":  # nvme streams the device's gradient shard chunk by chunk: no copy
        out[opt_tier]["optimizer"] += offload_grad_bytes * num_params / world_size
    return out


def tier_totals(
    by_tier: Mapping[str, Mapping[str, float]], categories: Iterable[str] = MODEL_STATE
) -> dict[str, float]:
    """``{tier: sum over categories}`` of a ``{tier: {category: bytes}}`` mapping."""
    cats = tuple(categories)
    return {t: float(sum(by_tier.get(t, {}).get(c, 0) for c in cats)) for t in TIERS}


def offload_choices(stage: int) -> list[tuple[str, str]]:
    """The valid ``(offload_optimizer, offload_param)`` pairs at ``stage``."""
    opt = ("none",) if stage == 0 else OFFLOAD_CHOICES
    par = OFFLOAD_CHOICES if stage == 3 else ("none",)
    return [(o, p) for o in opt for p in par]


# ---------------------------------------------------------------------- measurement
def process_stats(device: torch.device) -> dict[str, int]:
    """What the process and (on CUDA) the caching allocator say now.

    CUDA: ``allocated``/``reserved`` bytes and ``peak_allocated`` since the last
    :func:`reset_peak`. Every device: ``rss`` (resident set now, Linux ``/proc/self/statm``;
    0 elsewhere) and ``peak_rss`` (the process's lifetime peak, ``getrusage``)."""
    out: dict[str, int] = {}
    if device.type == "cuda" and torch.cuda.is_available():
        # the nested form: memory_stats() flattens and sorts a few hundred entries in Python, on
        # the training step's path three times a step
        s = torch.cuda.memory_stats_as_nested_dict(device)
        allocated = s.get("allocated_bytes", {}).get("all", {})  # {"current", "peak", ...}: every pool
        out["allocated"] = int(allocated.get("current", 0))
        out["reserved"] = int(s.get("reserved_bytes", {}).get("all", {}).get("current", 0))
        out["peak_allocated"] = int(allocated.get("peak", 0))
    out["rss"] = _rss_bytes()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    out["peak_rss"] = int(peak if sys.platform == "darwin" else peak * 1024)
    return out


def _rss_bytes() -> int:
    """Resident bytes now (``/proc/self/statm``'s second field; 0 where there is none). Read with
    ``os.open``/``os.read``: no text-file object, on the training step's path three times a step."""
    try:
        fd = os.open("/proc/self/statm", os.O_RDONLY)
        try:
            pages = int(os.read(fd, 4096).split()[1])
        finally:
            os.close(fd)
    except (OSError, ValueError, IndexError):
        return 0
    return pages * resource.getpagesize()


def reset_peak(device: torch.device) -> None:
    """Start a new phase: reset the CUDA allocator's peak counter (nothing to reset on CPU)."""
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats(device)


def source_tiers(source: Any) -> dict[str, int]:
    """``{tier: bytes}`` of a registered component: ``memory_by_tier()`` if it has one, else its
    ``nbytes`` (attribute or method) on the device."""
    if hasattr(source, "memory_by_tier"):
        got = dict(source.memory_by_tier())
        bad = sorted(set(got) - set(TIERS))
        if bad:
            raise ValueError(f"{type(source).__name__}.memory_by_tier() returned tiers {bad}; use {TIERS}")
        return {t: int(got.get(t, 0)) for t in TIERS}
    nb = getattr(source, "nbytes", None)
    if nb is None:
        raise TypeError(f"{type(source).__name__} has neither memory_by_tier() nor nbytes; give it one to track it")
    return {"device": int(nb() if callable(nb) else nb), "host": 0, "disk": 0}


def account(
    units: Iterable[FlatUnit], sources: Mapping[str, Iterable[Any]], device: torch.device
) -> dict[str, dict[str, int]]:
    """``{tier: {category: bytes}}`` this rank holds now: the units' parameter (and hpZ) and
    gradient buffers on the tier their tensors live on (the model's device, else host), plus every
    registered source's ``memory_by_tier`` under its category. A source registered under
    ``params`` (an offloaded parameter store) owns the sharded units' ``param_shard`` and the
    frozen units' stored shards: it reports them (and any device staging copy) itself, so they are
    not counted twice here."""
    out = {t: {c: 0 for c in CATEGORIES} for t in TIERS}
    on_device, on_host, kind = out["device"], out["host"], device.type

    def add(cat: str, t: torch.Tensor | None) -> None:
        if t is not None:
            (on_device if t.device.type == kind else on_host)[cat] += _nbytes(t)

    store_owns_shards = bool(list(sources.get("params", ())))
    for u in units:
        if u.kind == "frozen":  # stage 3's frozen shard as stored (frozen.py); an offload store reports its own
            if not store_owns_shards:
                add("params", fz.held(u))
            add("params", u.extra.get("original"))  # host copy of rounded originals
        elif u.kind != "sharded":
            add("params", u.flat)
        elif not store_owns_shards:
            add("params", u.param_shard)
        add("params", u.secondary)
        if u.grad_shard is not None:
            add("grads", u.grad_shard)
        else:
            for p in u.params:
                add("grads", p.grad)
    for cat, objs in sources.items():
        if cat not in CATEGORIES:
            raise ValueError(f"memory category {cat!r} is not one of {CATEGORIES}")
        for obj in objs:
            for t, b in source_tiers(obj).items():
                out[t][cat] += b
    return out


@dataclass
class MemorySnapshot:
    """One rank's memory at the end of one phase."""

    phase: str
    """One of :data:`PHASES`."""
    tiers: dict[str, dict[str, int]]
    """``{tier: {category: bytes}}`` from the runtime's accounting (:func:`account`)."""
    process: dict[str, int] = field(default_factory=dict)
    """:func:`process_stats` at the same moment (allocator figures on CUDA, RSS everywhere)."""
    peak: int = 0
    """Peak device bytes during the phase: the CUDA allocator's peak on GPUs; on CPU ranks the
    runtime's accounted device total (the most that is observable at the phase boundaries)."""
    peak_source: str = "accounting"
    """``cuda_allocator`` or ``accounting``: where ``peak`` comes from."""

    def tier_total(self, tier: str) -> int:
        return sum(self.tiers[tier].values())

    @property
    def total(self) -> int:
        return sum(self.tier_total(t) for t in TIERS)

    def to_dict(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "tiers": {t: dict(c) for t, c in self.tiers.items()},
            "tier_totals": {t: self.tier_total(t) for t in TIERS},
            "total": self.total,
            "process": dict(self.process),
            "peak": self.peak,
            "peak_source": self.peak_source,
        }


def _with_peak(phase: str, tiers: dict[str, dict[str, int]], device: torch.device) -> MemorySnapshot:
    """The snapshot of ``tiers`` with the process figures and the phase's peak: the CUDA
    allocator's on GPUs, else the accounted device bytes."""
    proc = process_stats(device)
    if "peak_allocated" in proc:
        peak, src = proc["peak_allocated"], "cuda_allocator"
    else:
        peak, src = sum(tiers["device"].values()), "accounting"
    return MemorySnapshot(phase=phase, tiers=tiers, process=proc, peak=peak, peak_source=src)


def flat_snapshot(phase: str, flat: Mapping[str, int], device: torch.device) -> MemorySnapshot:
    """A snapshot from a flat model-state report (``params``/``grads``/``optimizer``[/``hpz_secondary``]),
    all on the device: for trainers without the engine's tiered accounting (DDP, FSDP2)."""
    tiers = {t: {c: 0 for c in CATEGORIES} for t in TIERS}
    for c in MODEL_STATE:
        tiers["device"][c] = int(flat.get(c, 0))
    tiers["device"]["params"] += int(flat.get("hpz_secondary", 0))
    return _with_peak(phase, tiers, device)


def snapshot(
    phase: str, units: Iterable[FlatUnit], sources: Mapping[str, Iterable[Any]], device: torch.device
) -> MemorySnapshot:
    """This rank's :class:`MemorySnapshot` now, closing ``phase`` (then call :func:`reset_peak`)."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    tiers = account(units, sources, device)
    return _with_peak(phase, tiers, device)
