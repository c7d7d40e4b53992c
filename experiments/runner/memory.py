"""``python -m experiments.memory [--predict-only] [--run-dir DIR] [overrides]``: memory per rank,
predicted and measured.

Takes the runner's Hydra overrides (``model=large topology=2x2 stage=3 zero.offload_optimizer=cpu``)
and prints, as markdown tables:

1. **predicted**: ZeRO's model-state bytes per rank on each tier (device, host, disk) for every
   stage x offload choice of that model (Ψ from the model config) and world, as DeepSpeed's
   ``estimate_zero{2,3}_model_states_mem_needs`` estimates them (``zeropp.runtime.memory.
   expected_by_tier``); the row of the chosen config is marked ``*``. An ``nvme`` tier also
   needs the bounded host staging buffers (``zero.swap_buffers x zero.swap_buffer_size`` fp32).
2. **measured** (unless ``--predict-only``): a short run of the chosen config through the runner
   (``run.run_job``; ``train.steps=2`` and ``logger=none`` unless given) and its ``memory.json``:
   per phase, the rank with the most device bytes, per tier and category, with the peak; then the
   model state at the end of backward beside the prediction, per tier, with the ratio.

The short run trains for real (same ranks, device and data as ``experiments.runner.run``), so on a GPU
it also gives the CUDA allocator's peaks, i.e. the activations and transient buffers the
formulas leave out.

The classic per-phase study of a user's own module (a plain MLP wrapped by ``ZeroEngine``
directly, every stage side by side, table and plot) is ``python -m experiments.memory_study``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NoReturn

from ..launch.command import run_command
from .console import human_bytes
from .metrics import read_summary

SHORT_RUN = ("train.steps=2", "logger=none")
"""Defaults added to the measured run's overrides unless the key is given."""


def _compose(overrides: list[str]) -> tuple[Any, str]:
    """The validated RunConfig of ``overrides`` and the chosen model's name."""
    from hydra import compose, initialize_config_module

    from . import schema
    from .config import from_omegaconf, without_hydra
    from .overrides import check_overrides

    schema.register()
    check_overrides(overrides)
    with initialize_config_module("zeropp.conf", version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    name = cfg.hydra.runtime.choices.get("model") or ""
    return from_omegaconf(without_hydra(cfg)), name


def predictions(rc: Any) -> list[dict[str, Any]]:
    """One row per stage x (offload_optimizer, offload_param): the formula's bytes per tier for this
    run's model and world (``preflight.model_state_by_tier``: the tensor-parallel slice over the
    data-parallel ranks, no gradient or optimizer state for a LoRA base). The chosen row is the
    trainer's stage (DDP: 0, FSDP2: 3) with the run's offload choices. :class:`config.ConfigError`
    for ``topology.tp > 1`` with ``zero.persistence_threshold``, which the formula cannot split."""
    from zeropp.runtime.memory import offload_choices, tier_totals

    from .config import ConfigError
    from .preflight import model_state_by_tier, persistent_params

    z = rc.zero
    if rc.topology.tp > 1 and z.persistence_threshold > 0 and rc.trainer_spec.zero_engine:
        raise ConfigError(
            f"python -m experiments.memory cannot predict topology.tp={rc.topology.tp} with "
            f"zero.persistence_threshold={z.persistence_threshold}: which parameters stay whole depends on their "
            "tensor-parallel slices, which the formula (Ψ/tp) does not see; predict with "
            "zero.persistence_threshold=0 or topology.tp=1, or measure the run itself (python -m experiments.run "
            "... writes memory.json with the engine's own counts)"
        )
    fixed = rc.trainer_spec.fixed_stage
    run_stage = z.stage if fixed is None else fixed
    whole = persistent_params(rc)  # stage 3's rows: under zero.persistence_threshold, kept whole
    rows = []
    for stage in range(4):
        for opt, par in offload_choices(stage):
            by = model_state_by_tier(rc, stage=stage, offload_optimizer=opt, offload_param=par, persistent=whole)
            swap = 4 * z.swap_buffers * z.swap_buffer_size if "nvme" in (opt, par) else 0
            rows.append(
                {
                    "stage": stage,
                    "offload_optimizer": opt,
                    "offload_param": par,
                    "by_tier": by,
                    "tiers": tier_totals(by),
                    "swap_buffers_host": swap,
                    "chosen": (stage, opt, par) == (run_stage, z.offload_optimizer, z.offload_param),
                }
            )
    return rows


def predicted_table(rc: Any, rows: list[dict[str, Any]], model_name: str) -> str:
    z, t = rc.zero, rc.topology
    psi = rc.model.num_params()
    lines = [
        f"Predicted model state per rank: model={model_name or '?'} (Ψ = {psi:,} parameters), "
        f"{t.nodes}x{t.ranks_per_node} = {t.world_size} ranks, precision={z.precision}"
        + (", hpZ" if z.hpz else "")
        + (
            f", tp={t.tp}: ZeRO over {t.dp_size} data-parallel rank(s) of about Ψ/{t.tp} each (embeddings and "
            "norms, whole on every tp rank, are counted split: a lower bound)"
            if t.tp > 1
            else ""
        )
        + (
            f", LoRA rank {rc.model.lora_rank}: the frozen base has no gradient or optimizer state"
            if rc.model.lora_rank
            else ""
        )
        + (f", trainer={rc.trainer.name}" if not rc.trainer_spec.zero_engine else "")
        + " (* = the chosen config)",
        "",
        "| stage | offload_optimizer | offload_param | device | host | disk | total | + host swap buffers |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tt = r["tiers"]
        mark = "*" if r["chosen"] else ""
        swap = human_bytes(r["swap_buffers_host"]) if r["swap_buffers_host"] else ""
        lines.append(
            f"| {mark}{r['stage']} | {r['offload_optimizer']} | {r['offload_param']} | "
            f"{human_bytes(tt['device'])} | {human_bytes(tt['host'])} | {human_bytes(tt['disk'])} | "
            f"{human_bytes(sum(tt.values()))} | {swap} |"
        )
    return "\n".join(lines)


def _with_defaults(overrides: list[str]) -> list[str]:
    keys = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    return list(overrides) + [d for d in SHORT_RUN if d.split("=", 1)[0] not in keys]


def measured_table(doc: dict[str, Any], predicted: dict[str, Any] | None) -> str:
    """The memory.json of a run: per phase the rank with the most device bytes, then the end of
    backward's model state per tier beside ``predicted`` (a :func:`predictions` row)."""
    from zeropp.runtime.memory import MODEL_STATE, TIERS

    ranks = doc["ranks"]
    lines = [
        f"Measured: {doc.get('label')} ({len(ranks)} ranks; per phase the rank with the most device bytes)",
        "",
        "| phase | rank | device | params | grads | optimizer | activations | buffers | host | disk | peak | rss |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for phase in ranks[0]["phases"]:
        r, p = max(
            ((x["rank"], x["phases"][phase]) for x in ranks if phase in x["phases"]),
            key=lambda rp: rp[1]["tier_totals"]["device"],
        )
        d, tt = p["tiers"]["device"], p["tier_totals"]
        lines.append(
            f"| {phase} | {r} | {human_bytes(tt['device'])} | "
            + " | ".join(human_bytes(d[c]) for c in ("params", "grads", "optimizer", "activations", "buffers"))
            + f" | {human_bytes(tt['host'])} | {human_bytes(tt['disk'])} | {human_bytes(p['peak'])} "
            f"({p['peak_source']}) | {human_bytes(p['process'].get('rss', 0))} |"
        )
    if predicted is not None:
        lines += [
            "",
            "Model state (params + grads + optimizer) at the end of backward vs the formula, max over ranks:",
            "",
            "| tier | measured | predicted | measured / predicted |",
            "|---|---|---|---|",
        ]
        for t in TIERS:
            got = max(
                sum(x["phases"]["backward"]["tiers"][t][c] for c in MODEL_STATE)
                for x in ranks
                if "backward" in x["phases"]
            )
            want = predicted["tiers"][t]
            ratio = f"{got / want:.3f}" if want else ("-" if got == 0 else "inf")
            lines.append(f"| {t} | {human_bytes(got)} | {human_bytes(want)} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Print the tables; returns ``{"predicted": rows, "measured": memory.json or None, "run_dir"}``."""
    ap = argparse.ArgumentParser(prog="python -m experiments.memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--predict-only", action="store_true", help="print the formulas only; run nothing")
    ap.add_argument(
        "--run-dir", type=Path, default=None, help="where the short run writes (default: a new temporary directory)"
    )
    a, overrides = ap.parse_known_args(argv)
    bad = [o for o in overrides if o.startswith("-")]
    if bad:
        ap.error(f"unknown option(s) {bad}; everything else must be a Hydra override key=value")
    from .config import ConfigError

    try:
        rc, model_name = _compose(overrides)
        rows = predictions(rc)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(predicted_table(rc, rows, model_name))
    out: dict[str, Any] = {"predicted": rows, "measured": None, "run_dir": None}
    if a.predict_only:
        return out
    if not rc.trainer_spec.zero_engine:
        print(f"\n(trainer={rc.trainer.name}: measured figures are its flat model state only)")
    from .run import run_job

    run_dir = a.run_dir or Path(tempfile.mkdtemp(prefix=f"zeropp-memory-{time.strftime('%H%M%S')}-"))
    try:  # the runner's own checks before any rank: a --run-dir holding a run, a disk too small, ...
        run_job(_with_defaults(overrides), run_dir, dir_key="--run-dir")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    doc = read_summary(Path(run_dir) / "memory.json")
    chosen = next((r for r in rows if r["chosen"]), None) if rc.trainer_spec.zero_engine else None
    print()
    print(measured_table(doc, chosen))
    print(f"\nrun: {run_dir}")
    out.update(measured=doc, run_dir=str(run_dir))
    return out


def cli() -> NoReturn:
    """The command: :func:`main`, ended by ``launch.command.run_command`` (Ctrl-C or a failed world
    is one ``error:`` line and the shell's exit status, never a traceback)."""
    run_command(main)


if __name__ == "__main__":
    cli()
