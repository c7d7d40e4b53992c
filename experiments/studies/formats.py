"""``python -m experiments.formats``: which wire format suits which tensor.

Captures the weights, gradients and weight differences of a short GPT training run on text
(``format_capture``), sends each (kind, layer type) through every chosen format's codec and back
(``format_metrics``), and prints per kind and format: wire bits per element (scales included),
SQNR per layer type and over all, the largest error (of the tensor's range) and the bias (mean
error, of the RMS); then the CPU encode / decode throughput of each format on the captured
gradients as a share of a memory copy in the same run. Writes ``formats.json`` and ``formats.md``
into ``--out``.

    python -m experiments.formats                                   # defaults (~1 min on 2 cores)
    python -m experiments.formats --formats int8,fp8,mxfp8 --model tiny --steps 5
    python -m experiments.formats --formats int4@g32,int4@g128+had,int4+sr

A format is a name of ``zeropp.comm.spec.RECIPES`` (``int8``, ``fp8``, ``mxfp4``, ...; a recipe
names the spec of each kind: its weight spec is used for weights, its gradient spec for
gradients, its weight-difference spec for weight differences, the first one it has where it
has none), optionally followed by ``@g<N>`` (group size), ``+had`` (Hadamard rotation) and ``+sr``
(stochastic rounding). A gradient spec's cross-node width is measured (one hop). The group size
of a spec that leaves it open is the use's default: ``DEFAULT_WEIGHT_GROUP_SIZE`` for weights and
weight differences, ``DEFAULT_GRAD_GROUP_SIZE`` for gradients, as in the runtime.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any, NoReturn

import torch

from zeropp.comm.spec import RECIPES, QuantSpec
from zeropp.output_files import path_arg
from zeropp.runtime.plan_kinds import group_size_of

from ..launch.command import run_command
from ..projection.text_table import Column, number, text_table
from ..runner.checks import ConfigError
from ..runner.console import human_bytes
from ..runner.preflight import check_writable_dir, host_memory
from .format_capture import KINDS, LAYER_TYPES, CaptureConfig, capture
from .format_metrics import as_rows, copy_gbs, measure, speed
from .report_files import ReportError, check_outputs, write_outputs

OUTPUTS = ("formats.json", "formats.md")
"""What the study writes into ``--out``; a file of these names that it did not write is refused (report_files)."""

DEFAULT_FORMATS = (
    "int8", "fp8", "mxfp8", "mxint8", "mxfp6",
    "int4@g128", "mxfp4", "nvfp4", "int4@g128+had", "mxfp4+had", "nvfp4+had",
)  # fmt: skip
"""The formats compared when ``--formats`` is not given."""

_KIND_FIELDS = {"weights": "weights", "grads": "grads", "weight_diffs": "weight_diff"}
IS_WEIGHTS = {"weights": True, "grads": False, "weight_diffs": True}
"""Whether a kind takes the weights' default group size (``plan_kinds.group_size_of``) when its
spec leaves it open: weights and weight differences do, gradients take the gradients'."""
"""Group size of a spec that leaves it open, per kind (the runtime's defaults for the use)."""

_NAME = re.compile(r"^(?P<recipe>[A-Za-z0-9_]+)(?:@g(?P<group>\d+))?(?P<mods>(?:\+(?:had|sr))*)$")


def format_specs(name: str) -> dict[str, QuantSpec]:
    """``name`` (``<recipe>[@g<N>][+had][+sr]``) -> the spec of each kind; a ``ConfigError`` that
    says what to write for an unknown recipe, a recipe that quantizes nothing, or a spec the
    modifiers make invalid (e.g. a rotation block that does not divide the group)."""
    m = _NAME.match(name)
    if m is None:
        raise ConfigError(f"--formats: {name!r} is not <recipe>[@g<N>][+had][+sr] (e.g. int4@g128+had)")
    recipe = RECIPES.get(m["recipe"])
    if recipe is None:
        raise ConfigError(f"--formats: unknown recipe {m['recipe']!r}; choose from {sorted(RECIPES)}")
    own = {k: getattr(recipe, f) for k, f in _KIND_FIELDS.items()}
    first = next((s for s in own.values() if s is not None), None)
    if first is None:
        raise ConfigError(f"--formats: recipe {m['recipe']!r} quantizes nothing; pick one that sets a spec")
    changes: dict[str, Any] = {}
    if m["group"]:
        changes["group_size"] = int(m["group"])
    mods = m["mods"].split("+")[1:]
    if "had" in mods:
        changes["rotation"] = "hadamard"
    if "sr" in mods:
        changes["rounding"] = "stochastic"
    out = {}
    for kind in KINDS:
        spec = own[kind] or first
        spec = spec.replace(intra_bits=None, error_feedback=False, residual_bits=8)
        try:
            out[kind] = spec.replace(**changes)
            out[kind].rotation_block(group_size_of(out[kind], weights=IS_WEIGHTS[kind]))
        except ValueError as e:
            raise ConfigError(f"--formats: {name!r} for {kind}: {e}") from None
    return out


def study(formats: list[str], cfg: CaptureConfig, *, chunk: int, repeats: int, speed_mib: float) -> dict[str, Any]:
    """Capture, measure every format on every (kind, layer type), time each on the gradients."""
    specs = {f: format_specs(f) for f in formats}  # every name checked before the run
    tensors = capture(cfg)
    rows: list[dict[str, Any]] = []
    for kind in KINDS:
        for f in formats:
            spec = specs[f][kind]
            row: dict[str, Any] = {"kind": kind, "format": f, "spec": spec.label}
            for t in LAYER_TYPES:
                if t in tensors[kind]:
                    row[f"sqnr_{t}"] = measure(spec, tensors[kind][t], chunk=chunk, weights=IS_WEIGHTS[kind]).sqnr_db
            whole = measure(spec, torch.cat(list(tensors[kind].values())), chunk=chunk, weights=IS_WEIGHTS[kind])
            row.update(bits=whole.bits_per_element, sqnr=whole.sqnr_db, max_error=whole.max_error, bias=whole.bias)
            rows.append(row)
    flat = torch.cat(list(tensors["grads"].values()))
    n = max(chunk, int(speed_mib * 2**20) // 4 // chunk * chunk)  # whole rows, past the caches
    grads, _ = as_rows(flat.repeat(math.ceil(n / flat.numel()))[:n], chunk)  # [n / chunk, chunk]
    base = copy_gbs(grads, repeats)
    speeds = []
    for f in formats:
        s = speed(specs[f]["grads"], grads, weights=False, copy=base, repeats=repeats)
        speeds.append(
            {
                "format": f,
                "quantize_gbs": s.quantize_gbs,
                "quantize_of_copy": s.quantize_of_copy,
                "dequantize_gbs": s.dequantize_gbs,
                "dequantize_of_copy": s.dequantize_of_copy,
            }
        )
    return {
        "capture": vars(cfg),
        "chunk": chunk,
        "speed_mib": grads.numel() * 4 / 2**20,
        "copy_gbs": base,
        "rows": rows,
        "speed": speeds,
    }


def _db(key: str):
    def cell(r: dict[str, Any]) -> str:
        v = r.get(key)
        return "-" if v is None else ("exact" if math.isinf(v) else f"{v:.1f}")

    return cell


def tables(result: dict[str, Any]) -> str:
    """The result as text: one table per kind, then the speed table."""
    cols = [
        Column(title="format", width=18, cell=lambda r: r["format"], left=True),
        Column(title="bits/el", width=7, cell=number("bits", ".2f")),
        *(Column(title=f"SQNR {t}", width=max(9, 5 + len(t)), cell=_db(f"sqnr_{t}")) for t in LAYER_TYPES),
        Column(title="SQNR all", width=8, cell=_db("sqnr")),
        Column(title="max err", width=8, cell=number("max_error", ".2%")),
        Column(title="bias", width=9, cell=number("bias", "+.1e")),
    ]
    parts = []
    for kind in KINDS:
        parts.append(f"{kind} (SQNR in dB; max err of the tensor's largest |x|; bias = mean error / RMS)")
        parts.append(text_table(cols, [r for r in result["rows"] if r["kind"] == kind]))
    parts.append(
        f"CPU speed on {result['speed_mib']:.0f} MiB of the gradients, tiled "
        f"(copy: {result['copy_gbs']:.2f} GB/s, same run)"
    )
    parts.append(
        text_table(
            [
                Column(title="format", width=18, cell=lambda r: r["format"], left=True),
                Column(title="quantize GB/s", width=13, cell=number("quantize_gbs", ".2f")),
                Column(title="of copy", width=7, cell=number("quantize_of_copy", ".0%")),
                Column(title="dequantize GB/s", width=15, cell=number("dequantize_gbs", ".2f")),
                Column(title="of copy", width=7, cell=number("dequantize_of_copy", ".0%")),
            ],
            result["speed"],
        )
    )
    return "\n\n".join(parts)


WORKING_COPIES = 4
"""fp32 copies of a timed tensor or of one wire row's message the study holds at once (the input,
its decoded copy, the wire bytes and a padded or rotated copy): its host-memory estimate."""


def _check_chunk_holds_a_group(chunk: int, name: str, specs: dict[str, QuantSpec]) -> None:
    """Refuse (ConfigError) a ``--chunk`` smaller than a group of ``name``'s specs: each row would be
    one padded group carrying its scales, so bits per element and GB/s would describe the padding,
    not the format (a message is never smaller than one group)."""
    for kind, spec in specs.items():
        group = group_size_of(spec, weights=IS_WEIGHTS[kind])
        if chunk < group:
            raise ConfigError(
                f"--chunk {chunk} is smaller than one group of {name} for {kind} ({group} elements): the figures would "
                f"measure the padding; use --chunk {group} or more (or a smaller group: {name.split('@')[0]}@g<N>)"
            )


def _check_host_memory(chunk: int, speed_mib: float) -> None:
    """Refuse (ConfigError) a ``--chunk`` or ``--speed-mib`` whose tensors this host cannot hold:
    before, the study trained and then died of the allocation with its traceback."""
    have = host_memory()
    for flag, value, nbytes in (("--chunk", chunk, 4 * chunk), ("--speed-mib", speed_mib, speed_mib * (1 << 20))):
        if not math.isfinite(nbytes):
            raise ConfigError(f"{flag} {value}: give a finite size")
        if WORKING_COPIES * nbytes > have:
            raise ConfigError(
                f"{flag} {value} needs about {human_bytes(WORKING_COPIES * nbytes)} of host memory "
                f"({WORKING_COPIES} fp32 copies) but this host has {human_bytes(have)}; give a smaller {flag}"
            )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse, run, print and save (exit 2 on a bad option)."""
    d = CaptureConfig()
    ap = argparse.ArgumentParser(prog="python -m experiments.formats", description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default=",".join(DEFAULT_FORMATS), help="comma-separated formats (see above)")
    ap.add_argument("--model", default=d.model, help=f"GPT preset (default {d.model})")
    ap.add_argument("--steps", type=int, default=d.steps, help=f"training steps before the capture (default {d.steps})")
    ap.add_argument("--seed", type=int, default=d.seed, help=f"initialization and data seed (default {d.seed})")
    ap.add_argument("--chunk", type=int, default=1 << 16, help="elements per wire row (one message; default 65536)")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats per speed figure, median kept (default 5)")
    ap.add_argument("--speed-mib", type=float, default=64, help="fp32 MiB timed per speed figure (default 64)")
    ap.add_argument("--out", type=path_arg, default=Path("outputs/formats"), help="output directory")
    a = ap.parse_args(argv)
    try:
        if a.chunk < 1 or a.repeats < 1 or not a.speed_mib > 0:
            raise ConfigError("--chunk and --repeats must be >= 1 and --speed-mib > 0")
        _check_host_memory(a.chunk, a.speed_mib)
        cfg = CaptureConfig(model=a.model, steps=a.steps, seed=a.seed)
        formats = [f.strip() for f in a.formats.split(",") if f.strip()]
        if not formats:
            raise ConfigError("--formats is empty; name at least one (e.g. int8)")
        twice = sorted({f for f in formats if formats.count(f) > 1})
        if twice:  # each would be captured, measured and tabled again, under one name
            raise ConfigError(f"--formats names {', '.join(twice)} more than once; name each format once")
        for f in formats:
            _check_chunk_holds_a_group(a.chunk, f, format_specs(f))
        check_writable_dir("out", a.out)
        check_outputs(a.out, OUTPUTS)
    except (ConfigError, ValueError) as e:  # ReportError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    result = study(formats, cfg, chunk=a.chunk, repeats=a.repeats, speed_mib=a.speed_mib)
    text = tables(result)
    print(text)
    try:
        write_outputs(
            a.out,
            {
                "formats.json": json.dumps(result, indent=1, default=str).encode(),
                "formats.md": ("```\n" + text + "\n```\n").encode(),
            },
        )
    except ReportError as e:  # the directory changed during the study
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"\nnumbers: {a.out / 'formats.json'}")
    return result


def cli() -> NoReturn:
    """The command: :func:`main`, ended by ``launch.command.run_command`` (Ctrl-C or a failed world
    is one ``error:`` line and the shell's exit status, never a traceback)."""
    run_command(main)


if __name__ == "__main__":
    cli()
