"""What a run records: ``metrics.jsonl`` (one line per logged step) and ``summary.json``.

Throughput is averaged over the steps after ``train.throughput_skip_steps`` (total tokens / total time, not
a mean of rates). Model TFLOP/s uses the PaLM accounting: per token, 6N for the matmuls of forward
and backward (N = parameters except the position embedding, which is a lookup, not a matmul) plus 12 * n_layers * d_model * seq_len for attention scores, times the tokens of all ranks.
Communication bytes are per rank per step, averaged over ranks, keyed ``<kind>.<link>`` (link
``intra`` or ``cross`` node): ``comm_bytes_per_step`` from CommWatch (every torch.distributed call,
any trainer, kinds like ``all_gather``), ``engine_comm_bytes_per_step`` from zeropp's CommStats
when the trainer has one (semantic kinds like ``fwd_all_gather``, ``grad_reduce_scatter``).
``comm_wait_s_per_step`` is the time the training thread was blocked inside collectives or
``Work.wait()`` (CommWatch); ``engine_comm_wait_s_per_step`` is ZeroEngine's own measure.
``cpu_s_per_step`` is the CPU time (user + system, every thread) of all ranks' processes per
measured step, summed over ranks: against ``step_time_s`` times the cores the ranks share it
says whether a step is bound by the CPU or waits with cores idle. ``uplink_tx_bytes_per_step``
(``cluster=emulated`` only, else None): the bytes one node's uplink sent per measured step, the
kernel's counter (headers and every rank of the node included), averaged over nodes; what
``experiments.bench_cluster`` compares with the projection's uplink bytes.

Memory: ``memory_per_rank`` is each rank's flat model-state report (end of backward);
``memory_by_phase`` gives per rank, per phase (``zeropp.runtime.memory.PHASES``: model_creation,
optimizer_creation, forward, backward, step; other trainers: model_creation and step), bytes
per tier (device, host, disk) and category (params, grads, optimizer, activations, buffers) with
the phase's peak and the process figures (``zeropp.runtime.memory.MemorySnapshot.to_dict``);
``memory_expected`` is ZeRO's formula for the run's config by tier. ``memory.json`` in the run
directory holds the same per-rank figures on their own (:func:`write_memory_json`).

Outcome: ``status`` is ``"completed"``, or ``"diverged"`` for a run the divergence guard stopped
(``zeropp.runtime.divergence``); then ``divergence`` holds the step, loss, gradient norm, reason
and message (non-finite numbers as the strings ``"nan"`` / ``"inf"``), the loss curve ends at
that step and there is no final eval loss. ``skipped_steps`` counts steps that made no update.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path
from typing import Any

from zeropp.comm import Topology
from zeropp.comm.choices import plain
from zeropp.input_files import parse_json, read_regular
from zeropp.runtime import ZeroConfig

from .config import RunConfig

SUMMARY_KEYS = (
    "label",
    "status",
    "tokens_per_s",
    "step_time_s",
    "model_tflops",
    "comm_bytes_per_step",
    "comm_wait_s_per_step",
    "memory_per_rank",
    "loss",
    "config",
)
"""Keys every summary.json has (tests and the report rely on them)."""


def flops_per_token(cfg: RunConfig, n_params: int) -> float:
    m = cfg.model
    n = n_params - m.seq_len * m.d_model
    return 6.0 * n + 12.0 * m.n_layers * m.d_model * m.seq_len


def tokens_per_step(cfg: RunConfig) -> int:
    """Tokens of one optimizer step over all ranks (the ranks of a tensor-parallel group share theirs)."""
    return cfg.topology.dp_size * cfg.train.micro_batch_size * cfg.zero.grad_accum_steps * cfg.model.seq_len


class MetricsFile:
    """Appends one JSON object per line; flushed each line so a crash keeps what was logged.

    ``first_step``: the first step this run logs (``1``, or the checkpoint's step + 1 when
    resuming). Lines of an earlier attempt in the same file from that step on are cut off first, so
    a resumed run keeps the lines up to its checkpoint and every step appears once; so is a last
    line a crash cut short. The file is truncated in place at the byte offset of the first such
    line (one ``ftruncate``: no window in which the kept lines are missing).
    """

    def __init__(self, path: Path, *, first_step: int = 1) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._f = path.open("ab")
        self._f.truncate(_kept_bytes(path, first_step))

    def write(self, record: dict[str, Any]) -> None:
        self._f.write((json.dumps(record) + "\n").encode())
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def _kept_bytes(path: Path, first_step: int) -> int:
    """Bytes of ``path`` before its first line that is not a complete record of a step before
    ``first_step``."""
    kept = 0
    with path.open("rb") as f:
        for line in f:
            try:
                step = json.loads(line)["step"] if line.endswith(b"\n") else None
            except (ValueError, KeyError, TypeError):
                step = None
            if not isinstance(step, int) or step >= first_step:
                break
            kept += len(line)
    return kept


def link_totals(bytes_by_key: dict[str, float]) -> dict[str, float]:
    """``{"intra": .., "cross": ..}`` from ``{"<kind>.<link>": bytes}``."""
    out = {"intra": 0.0, "cross": 0.0}
    for k, v in bytes_by_key.items():
        link = k.rsplit(".", 1)[-1]
        if link in out:
            out[link] += v
    return out


def _mean_dicts(dicts: list[dict[str, float]], divisor: float) -> dict[str, float]:
    keys = sorted({k for d in dicts for k in d})
    return {k: sum(d.get(k, 0) for d in dicts) / max(divisor, 1) for k in keys}


def model_state_formula(
    z: ZeroConfig,
    t: Topology,
    *,
    stage: int,
    offload_optimizer: str,
    offload_param: str,
    trained: int,
    replicated: int = 0,
    frozen_bytes: float = 0.0,
) -> dict[str, dict[str, float]]:
    """ZeRO's per-rank model-state bytes ``{tier: {category: bytes}}`` of a ZeroEngine with ``z``'s
    precision and hpZ on topology ``t`` at ``stage`` with those offload choices: the one formula of
    both a run's ``memory_expected`` (:func:`expected_model_state`, with the engine's own counts)
    and ``python -m experiments.memory``'s predictions (``preflight.model_state_by_tier``, with
    counts from the config). ``trained``: the trainable parameters one rank's engine partitions
    (the TP-local ones under ``topology.tp``), over the data-parallel ranks. ``replicated``: of
    ``trained``, those a stage-3 engine keeps whole on every rank (its ``persistent`` unit, under
    ``zero.persistence_threshold``): parameters and gradients on the device unsharded, optimizer
    state whole on ``offload_optimizer``'s tier (ZeRO's formula at N = 1). ``frozen_bytes``: the
    frozen (LoRA base) bytes the rank stores, on ``offload_param``'s tier, plus hpZ's secondary copy
    of the stage-3 shards (the ``dp_size / hpz_size`` shards of the rank's node share) on the device."""
    from zeropp.runtime.memory import OFFLOAD_TIER, expected_by_tier, hpz_bytes_per_param

    pbytes = z.dtype.itemsize
    # with tensor parallelism hpZ's group is the node's ranks of this rank's tp slice
    hpz = max(1, (z.hpz_size or t.ranks_per_node) // t.tp) if z.hpz and stage == 3 else None
    out = expected_by_tier(
        stage,
        max(0, trained - replicated),
        t.dp_size,
        param_bytes=pbytes,
        hpz_size=hpz,
        hpz_bytes=hpz_bytes_per_param(z.weights, pbytes, weight_diff=z.weight_diff is not None),
        offload_optimizer=offload_optimizer,
        offload_param=offload_param,
        shared_master=z.shares_fp32_master,
    )
    if replicated:  # one unit sharded over nobody: stage 1's formula on one rank, parameters on the device
        whole = expected_by_tier(
            1,
            replicated,
            1,
            param_bytes=pbytes,
            offload_optimizer=offload_optimizer,
            shared_master=z.shares_fp32_master and offload_param == "none",
        )
        for tier, cats in whole.items():
            for cat, b in cats.items():
                out[tier][cat] += b
    out[OFFLOAD_TIER[offload_param]]["params"] += frozen_bytes
    out["device"]["params"] += frozen_bytes * (t.dp_size // hpz if hpz else 0)
    return out


def expected_model_state(
    cfg: RunConfig, n_params: int, *, frozen_bytes: int = 0, replicated: int = 0
) -> dict[str, dict[str, float]] | None:
    """ZeRO's per-rank model-state bytes ``{tier: {category: bytes}}`` for a ZeroEngine run of
    ``cfg`` (None for the other trainers, whose memory the formulas do not describe), from what the
    engine reports: ``n_params`` trained parameters of one rank's engine, ``frozen_bytes`` of
    stage-3 frozen shards as stored (compute dtype, or MixZ++'s wire rows) and ``replicated``
    persistent parameters (:func:`model_state_formula`)."""
    if not cfg.trainer_spec.zero_engine:
        return None
    z = cfg.zero
    return model_state_formula(
        z,
        cfg.topology,
        stage=z.stage,
        offload_optimizer=z.offload_optimizer,
        offload_param=z.offload_param,
        trained=n_params,
        replicated=replicated,
        frozen_bytes=frozen_bytes,
    )


def build_summary(
    *,
    cfg: RunConfig,
    rank_reports: list[dict[str, Any]],
    step_times: list[float],
    losses: list[float],
    eval_loss: float | None,
    n_params: int,
    run_dir: str,
    overrides: list[str],
    device: str,
    backend: str,
    label: str,
    model_name: str,
    first_step: int = 1,
    divergence: dict[str, Any] | None = None,
    skipped_steps: int = 0,
) -> dict[str, Any]:
    """Aggregate per-rank reports (gathered on rank 0) into the summary.json dict.

    Each rank report has ``wire_bytes`` and ``engine_bytes`` (totals over measured steps),
    ``wait_s`` (total), ``measured_steps``, ``memory`` (model-state bytes by part) and
    ``cpu_s`` (the process's CPU seconds over the measured steps; absent: no ``cpu_s_per_step``),
    ``uplink_tx_bytes`` (a node's first rank on an emulated cluster: its uplink's bytes over the
    measured steps; else None or absent).
    ``divergence``: ``DivergenceError.record()`` of a run stopped as diverged (its ``status`` is
    then ``"diverged"``, else ``"completed"``); ``skipped_steps``: steps that made no update.
    """
    w = max(0, cfg.train.throughput_skip_steps - (first_step - 1))
    measured = step_times[w:] or step_times
    total_time = sum(measured)
    tps = tokens_per_step(cfg) * len(measured) / total_time if total_time > 0 else 0.0
    fpt = flops_per_token(cfg, n_params)
    world = len(rank_reports)
    n_meas = max(1, rank_reports[0]["measured_steps"])
    wire = _mean_dicts([r["wire_bytes"] for r in rank_reports], world * n_meas)
    engine = [r["engine_bytes"] for r in rank_reports if r.get("engine_bytes") is not None]
    engine_mean = _mean_dicts(engine, len(engine) * n_meas) if engine else None
    wait = sum(r["wait_s"] for r in rank_reports) / (world * n_meas)
    eng_wait = sum(r.get("engine_wait_s", 0.0) for r in rank_reports) / (world * n_meas)
    cpu = sum(r["cpu_s"] for r in rank_reports) / n_meas if all("cpu_s" in r for r in rank_reports) else None
    uplinks = [u for r in rank_reports if (u := r.get("uplink_tx_bytes")) is not None]
    step_mean = total_time / len(measured) if measured else math.nan
    mems = [r["memory"] for r in rank_reports]
    phases = [r.get("memory_phases") or {} for r in rank_reports]
    return {
        "label": label,
        "status": "diverged" if divergence is not None else "completed",
        "divergence": divergence,
        "skipped_steps": skipped_steps,
        "trainer": cfg.trainer.name,
        "zero": plain(dataclasses.asdict(cfg.zero)),  # fixed choices as plain strings
        "topology": {
            "world_size": cfg.topology.world_size,
            "ranks_per_node": cfg.topology.ranks_per_node,
            "tp": cfg.topology.tp,
            "nodes": cfg.topology.nodes,
        },
        "model": {"name": model_name, "params": n_params, "flops_per_token": fpt},
        "tokens_per_step": tokens_per_step(cfg),
        "steps": len(step_times),
        "first_step": first_step,
        "measured_steps": len(measured),
        "tokens_per_s": tps,
        "step_time_s": {
            "mean": step_mean,
            "median": statistics.median(measured) if measured else math.nan,
            "min": min(measured, default=math.nan),
            "max": max(measured, default=math.nan),
        },
        "model_tflops": tps * fpt / 1e12,
        "model_tflops_per_rank": tps * fpt / 1e12 / world,
        "comm_bytes_per_step": {
            "by_kind_link": wire,
            "by_link": link_totals(wire),
            "total": sum(wire.values()),
            "source": "torch.distributed (wire bytes)",
        },
        "engine_comm_bytes_per_step": None
        if engine_mean is None
        else {"by_kind_link": engine_mean, "by_link": link_totals(engine_mean), "total": sum(engine_mean.values())},
        "comm_wait_s_per_step": wait,
        "engine_comm_wait_s_per_step": eng_wait if engine_mean is not None else None,
        "comm_wait_fraction": wait / step_mean if step_mean and step_mean > 0 else math.nan,
        "cpu_s_per_step": cpu,
        "uplink_tx_bytes_per_step": sum(uplinks) / (len(uplinks) * n_meas) if uplinks else None,
        "memory_per_rank": mems,
        "memory_max_rank_bytes": max((m.get("total", 0) for m in mems), default=0),
        "memory_by_phase": phases,
        "memory_peak_per_rank": [max((p.get("peak", 0) for p in ph.values()), default=0) for ph in phases],
        "memory_expected": expected_model_state(
            cfg,
            rank_reports[0].get("state_params") or n_params,
            frozen_bytes=rank_reports[0].get("frozen_bytes", 0),
            replicated=rank_reports[0].get("replicated_params", 0),
        ),
        "loss": {
            "first": losses[0] if losses else math.nan,
            "final": losses[-1] if losses else math.nan,
            "eval": eval_loss,
            "curve": losses,
        },
        "device": device,
        "backend": backend,
        "run_dir": run_dir,
        "overrides": overrides,
        "config": cfg.to_dict(),
    }


def write_summary(path: Path, summary: dict[str, Any]) -> None:
    def clean(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {str(k): clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    path.write_text(json.dumps(clean(summary), indent=2))


def write_memory_json(path: Path, summary: dict[str, Any]) -> None:
    """``memory.json``: per rank the per-phase, per-tier, per-category bytes and the peak, plus the
    formula for the config (same figures as the summary's ``memory_*`` keys, on their own)."""
    ranks = []
    for r, ph in enumerate(summary.get("memory_by_phase") or []):
        rss = [p.get("process", {}).get("peak_rss", 0) for p in ph.values()]
        ranks.append(
            {
                "rank": r,
                "phases": ph,
                "peak": summary["memory_peak_per_rank"][r],
                "peak_rss": max(rss, default=0),
                "model_state": summary["memory_per_rank"][r],
            }
        )
    doc = {
        "label": summary.get("label"),
        "model": summary.get("model"),
        "topology": summary.get("topology"),
        "zero": {
            k: summary.get("zero", {}).get(k)
            for k in ("stage", "precision", "hpz", "offload_optimizer", "offload_param")
        },
        "expected": summary.get("memory_expected"),
        "ranks": ranks,
    }
    write_summary(path, doc)


def read_summary(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` ([] when there is none); OSError when the path is not a
    regular file of bounded size (a FIFO there would block the reader forever: zeropp.input_files)."""
    p = Path(path)
    if not (p.exists() or p.is_symlink()):
        return []
    return [parse_json(line) for line in read_regular(p).decode().splitlines() if line.strip()]
