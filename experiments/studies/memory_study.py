"""``python -m experiments.memory_study [--width 1024] [--layers 12] [--out DIR] ...``: the classic
per-phase memory study of ZeRO, on a plain MLP wrapped by ``ZeroEngine``.

The model is what a user writes first: an ``nn.Sequential`` of ``Linear`` + ``ReLU`` (12 layers of
width 1024 by default: Ψ = 12.6 M parameters, so the figures read in MiB), Adam (AdamW without
weight decay), an MSE loss on ``WithTargets(x, y)`` micro-batches, one training step on 4 gloo CPU
ranks (``zeropp.experiments.launch.launch_world``). It is trained as the replicated baseline (stage 0),
ZeRO-1, ZeRO-2, ZeRO-3 (the default block rule makes each ``Linear`` a gather unit) and ZeRO-3
with the optimizer and the parameters offloaded to the CPU. For each, the memory of every rank
after model creation, optimizer creation, forward, backward and step (``ZeroEngine.memory_phases``;
``zeropp.runtime.memory.PHASES`` says what each holds) by tier (device / host) and category
(params, grads, optimizer, activations, buffers) is printed as a table, drawn as stacked bars
(``<out>/memory_study.png``) and saved as JSON (``<out>/memory_study.json``).

It checks itself: the model state (params + grads + optimizer) at the end of backward, on every
rank and tier, against ZeRO's formula (``zeropp.runtime.memory.expected_by_tier``); the second
table says "matches the formula" or by how much it differs, and the command exits 1 when a
configuration differs. Which formula applies:

- ``--precision bf16``: the paper's mixed precision, 2-byte weights and gradients plus 12 bytes
  of fp32 master, m and v: 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N.
- ``--precision fp32`` (the default, like a plain ``torch.optim.Adam`` study): 4-byte weights and
  gradients, and the fp32 master *is* the weight (no second copy), so the optimizer holds m and v,
  8 bytes: 16Ψ, 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N, 16Ψ/N.
- CPU offload: the gradient shard stays on the device (gΨ/N); the host holds the parameter shard
  (pΨ/N), the optimizer with its own fp32 master (12Ψ/N) and the fp32 gradient copy the host
  step reads (4Ψ/N).

The formulas leave out activations and communication buffers; the tables show them apart.

Why a module here rather than ``examples/`` or a mode of ``python -m experiments.memory``: the
ranks are started by spawn, which imports the rank function by its module name, so it must live
in an importable, installed module (``zeropp.experiments.studies.memory_study``), which is also what the
tests import; and ``experiments.runner.memory`` is the Hydra runner's command for its GPT configs
(overrides, a real run through ``run_job``), while this study drives the engine API directly on
the user's own module, as the user would. Its tables and figure are ``memory_study_views.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.nn.functional as F
from torch import nn

from zeropp.output_files import path_arg

from ..launch.command import run_command
from ..runner.checks import ConfigError, check, pos_int
from ..runner.console import human_bytes
from ..runner.preflight import check_writable_dir, host_memory
from .memory_study_views import SHOWN_TIERS, check_table, phase_table, plot_png
from .report_files import ReportError, check_outputs, write_outputs

CONFIGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("stage 0 (replicated)", {"stage": 0}),
    ("ZeRO-1", {"stage": 1}),
    ("ZeRO-2", {"stage": 2}),
    ("ZeRO-3", {"stage": 3}),
    ("ZeRO-3 + CPU offload", {"stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}),
)
"""The study's configurations: label and ``ZeroConfig`` fields."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StudyConfig:
    """The study's size and where it writes; checked before any rank starts."""

    width: int = 1024
    """Features in and out of every ``Linear`` layer."""
    layers: int = 12
    """``Linear`` layers, each followed by a ``ReLU`` except the last."""
    batch: int = 16
    """Rows of each rank's micro-batch."""
    world: int = 4
    """Gloo CPU ranks (N in the formulas)."""
    precision: str = "fp32"
    """``fp32`` or ``bf16`` (compute and gradient dtype; see the module docstring for each formula)."""
    tolerance: float = 0.01
    """Relative difference from the formula still reported as a match, per tier: a unit's buffer
    is padded to a multiple of ``world`` elements, which adds at most ``world - 1`` elements per
    layer (none when ``world`` divides ``width * (width + 1)``, as at the defaults)."""
    out: Path = Path("memory_study")
    """Directory for ``memory_study.png`` and ``memory_study.json`` (created if missing)."""
    timeout_s: float = 300.0
    """Whole-run limit: the ranks are stopped and the study fails after this many seconds."""

    def __post_init__(self) -> None:
        for key in ("width", "layers", "batch", "world"):
            pos_int(key, getattr(self, key))
        check(self.precision in ("fp32", "bf16"), "precision", self.precision, "fp32 or bf16")
        check(0 <= self.tolerance < 1, "tolerance", self.tolerance, "a fraction in [0, 1)")
        check(self.timeout_s > 0, "timeout_s", self.timeout_s, "seconds > 0")

    @property
    def num_params(self) -> int:
        """Ψ: the MLP's parameters (weights and biases)."""
        return self.layers * (self.width * self.width + self.width)


def make_mlp(width: int, layers: int) -> nn.Sequential:
    """``layers`` x ``Linear(width, width)`` with a ``ReLU`` between consecutive ones."""
    mods: list[nn.Module] = []
    for i in range(layers):
        mods.append(nn.Linear(width, width))
        if i < layers - 1:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


def mse(output: torch.Tensor, mb: Any) -> torch.Tensor:
    """The study's loss: mean squared error against the micro-batch's targets."""
    return F.mse_loss(output.float(), mb.targets.float())


def study_rank(rank: int, world: int, cfg: StudyConfig) -> list[dict[str, Any]]:
    """One rank of the study (inside a gloo world): every configuration in turn, one step each;
    returns per configuration its units and ``{phase: MemorySnapshot.to_dict()}``."""
    from zeropp.runtime import OptimizerConfig, Precision, WithTargets, ZeroConfig, ZeroEngine

    dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(cfg.batch, cfg.width, generator=g).to(dtype)  # [B, W]
    y = torch.randn(cfg.batch, cfg.width, generator=g).to(dtype)  # [B, W]
    out = []
    for label, zero in CONFIGS:
        torch.manual_seed(0)
        engine = ZeroEngine(
            make_mlp(cfg.width, cfg.layers),
            config=ZeroConfig(precision=Precision(cfg.precision), **zero),
            optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.0),
            loss_fn=mse,
        )
        try:
            engine.train_step([WithTargets(x, y)])
            out.append(
                {
                    "label": label,
                    "units": len(engine.units),
                    "phases": {k: v.to_dict() for k, v in engine.memory_phases().items()},
                }
            )
        finally:
            engine.close()
        del engine
    return out


# ---------------------------------------------------------------------- the formula
def predicted(cfg: StudyConfig, zero: dict[str, Any], num_params: int, world: int) -> dict[str, dict[str, float]]:
    """ZeRO's model-state bytes per rank ``{tier: {category: bytes}}`` for one configuration."""
    from zeropp.runtime import Precision, ZeroConfig
    from zeropp.runtime.memory import expected_by_tier

    z = ZeroConfig(precision=Precision(cfg.precision), **zero)
    return expected_by_tier(
        z.stage,
        num_params,
        world,
        param_bytes=z.dtype.itemsize,
        offload_optimizer=z.offload_optimizer,
        offload_param=z.offload_param,
        shared_master=z.shares_fp32_master,
    )


def formula_text(cfg: StudyConfig, zero: dict[str, Any], tier: str) -> str:
    """One tier's formula as ``aΨ + bΨ/N``: bytes are ``a·Ψ + b·Ψ/N``, so ``a + b`` (N = 1) and
    ``a + b/2`` (N = 2) at Ψ = 1 give both coefficients."""
    from zeropp.runtime.memory import tier_totals

    one, two = (tier_totals(predicted(cfg, zero, 1, n))[tier] for n in (1, 2))
    b = 2 * (one - two)
    a = one - b
    terms = [f"{a:g}Ψ" if a else "", f"{b:g}Ψ/N" if b else ""]
    return " + ".join(t for t in terms if t) or "0"


def verdict(measured: dict[str, float], want: dict[str, float], tolerance: float) -> tuple[bool, str]:
    """``(matches, text)``: every tier of ``measured`` within ``tolerance`` (relative) of ``want``,
    else the tier that differs most, by how much."""
    worst, text = 0.0, "matches the formula"
    for t in SHOWN_TIERS + ("disk",):
        got, exp = measured.get(t, 0), want.get(t, 0)
        diff = got - exp
        rel = abs(diff) / exp if exp else (0.0 if diff == 0 else float("inf"))
        if rel > tolerance and rel > worst:
            worst = rel
            pct = f" ({diff / exp:+.1%})" if exp else ""
            text = f"differs: {t} {'+' if diff > 0 else '-'}{human_bytes(abs(diff))}{pct}"
    return worst == 0.0, text


# ---------------------------------------------------------------------- the run
def run_study(cfg: StudyConfig) -> dict[str, Any]:
    """Launch ``cfg.world`` gloo ranks of :func:`study_rank` and :func:`summarize` them."""
    from ..launch import launch_world

    per_rank = launch_world(
        study_rank, cfg.world, args=(cfg,), process_group="gloo", threads=1, timeout_s=cfg.timeout_s
    )
    return summarize(cfg, per_rank)


def summarize(cfg: StudyConfig, per_rank: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Check every rank's figures (``per_rank[r]``: :func:`study_rank`'s list) against the formula:
    returns ``{"config", "num_params", "runs": [...]}``, each run with ``label``, ``zero``,
    ``units``, ``ranks`` (per rank ``{phase: snapshot dict}``), ``predicted`` (``{tier: {category:
    bytes}}``), ``formula`` (``{tier: text}``), ``matches`` and ``check`` (the verdict's text)."""
    from zeropp.runtime.memory import MODEL_STATE, tier_totals

    psi = cfg.num_params
    runs = []
    for i, (label, zero) in enumerate(CONFIGS):
        ranks = [r[i]["phases"] for r in per_rank]
        want = predicted(cfg, zero, psi, cfg.world)
        ok, text = True, "matches the formula"
        for rank, phases in enumerate(ranks):  # every rank, the model state at the end of backward
            got = tier_totals(phases["backward"]["tiers"], MODEL_STATE)
            good, why = verdict(got, tier_totals(want), cfg.tolerance)
            if not good and ok:
                ok, text = False, f"rank {rank} {why}"
        runs.append(
            {
                "label": label,
                "zero": zero,
                "units": per_rank[0][i]["units"],
                "ranks": ranks,
                "predicted": want,
                "formula": {t: formula_text(cfg, zero, t) for t in SHOWN_TIERS},
                "matches": ok,
                "check": text,
            }
        )
    return {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(cfg).items()},
        "num_params": psi,
        "runs": runs,
    }


OUTPUTS = ("memory_study.png", "memory_study.json")
"""What the study writes into ``--out``; a file of these names that it did not write is refused
(report_files: an earlier study's files, listed in the manifest, are replaced)."""


def _check_host_memory(cfg: StudyConfig) -> None:
    """Refuse (ConfigError) a study whose replicated baseline cannot fit this host: at stage 0
    every rank holds the whole model state, 16 bytes per parameter (fp32 weights and gradients,
    AdamW's two moments), and all ranks run here. Beyond that a rank died of the allocation with
    its traceback, after the others had started."""
    need, have = 16 * cfg.num_params * cfg.world, host_memory()
    if need > have:
        raise ConfigError(
            f"invalid config: width={cfg.width} x layers={cfg.layers} is Ψ = {cfg.num_params:,} parameters; its "
            f"stage-0 baseline needs about {human_bytes(need)} on {cfg.world} ranks (16 bytes per parameter "
            f"each) but this host has {human_bytes(have)}; choose a smaller --width / --layers or fewer --world"
        )


def _prepare_out(out: Path) -> None:
    """Create ``out``, after the runner's own check (``preflight.check_writable_dir``: refused,
    before any rank starts, where it cannot be created or written) and the check that no file of
    :data:`OUTPUTS` there is someone else's."""
    check_writable_dir("out", out)
    try:
        check_outputs(out, OUTPUTS)
    except ReportError as e:
        raise ConfigError(f"invalid config: {e}") from None
    out.mkdir(parents=True, exist_ok=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse, run, print and save; returns the result (exits 2 on a bad option, 1 when a
    configuration differs from the formula or a rank fails)."""
    from rich.console import Console

    from ..launch import RankFailure, RunInterrupted

    d = StudyConfig()
    ap = argparse.ArgumentParser(prog="python -m experiments.memory_study", description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=d.width, help=f"Linear features (default {d.width})")
    ap.add_argument("--layers", type=int, default=d.layers, help=f"Linear layers (default {d.layers})")
    ap.add_argument("--batch", type=int, default=d.batch, help=f"rows per rank (default {d.batch})")
    ap.add_argument("--world", type=int, default=d.world, help=f"gloo CPU ranks (default {d.world})")
    ap.add_argument("--precision", default=d.precision, help="fp32 (default) or bf16")
    ap.add_argument(
        "--tolerance",
        type=float,
        default=d.tolerance,
        help=f"relative difference still called a match (default {d.tolerance})",
    )
    ap.add_argument("--out", type=path_arg, default=d.out, help=f"output directory (default ./{d.out})")
    a = ap.parse_args(argv)
    try:
        cfg = StudyConfig(
            width=a.width,
            layers=a.layers,
            batch=a.batch,
            world=a.world,
            precision=a.precision,
            tolerance=a.tolerance,
            out=a.out,
        )
        _check_host_memory(cfg)
        _prepare_out(cfg.out)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        result = run_study(cfg)
    except RunInterrupted:  # the study was stopped (Ctrl-C, SIGTERM): 128 + N, not a failed rank
        raise
    except RankFailure as e:
        print(f"error: the study's ranks failed: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    console = Console()
    if not console.is_terminal:
        console.width = 160  # a log file: keep each row on one line
    console.print(phase_table(result))
    console.print(check_table(result))
    try:
        png, js = write_outputs(
            cfg.out, {OUTPUTS[0]: plot_png(result), OUTPUTS[1]: json.dumps(result, indent=1).encode()}
        )
    except ReportError as e:  # the directory changed during the study
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    console.print(f"plot: {png}\nnumbers: {js}")
    differ = [r["label"] for r in result["runs"] if not r["matches"]]
    if differ:
        print(f"error: {', '.join(differ)} differ(s) from ZeRO's formula (see the check column)", file=sys.stderr)
        raise SystemExit(1)
    return result


def cli() -> NoReturn:
    """The command: :func:`main`, ended by ``launch.command.run_command`` (Ctrl-C or a failed world
    is one ``error:`` line and the shell's exit status, never a traceback)."""
    run_command(main)


if __name__ == "__main__":
    cli()
