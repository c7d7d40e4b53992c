"""A run's trained Hugging Face model, out as a directory ``transformers`` loads.

``python -m experiments.export <run dir or checkpoint dir> <out dir> [--lora-format merged|peft]``
writes the latest checkpoint of a ``model=hf`` run (any trainer, world size, stage or topology) as a
``save_pretrained`` directory (safetensors + ``config.json``):
``AutoModelForCausalLM.from_pretrained(<out dir>)`` then gives the trained model's logits. One
process, no GPU, no process group. The work is :func:`zeropp.models.hf_export.export_pretrained`;
this is its command line.

The model's settings come from the checkpoint (the runner records them there). A checkpoint saved
before they were recorded still exports from a run directory, with its ``summary.json``'s
``config.model``, or with ``--model-config`` naming such a file (a ``summary.json``, or a JSON
object of ``model.*`` settings). Errors print ``error: ...`` and exit with status 2; a write the
system refuses (a full disk) exits with status 1, leaving nothing in ``out_dir``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, NoReturn

from zeropp.input_files import read_regular
from zeropp.output_files import OutputWriteError, path_arg

from ..launch.command import run_command

SETTINGS_LIMIT = 64 << 20
"""The largest settings file read (a run's summary.json is a few hundred KiB)."""


def _model_settings(path: Path) -> dict[str, Any]:
    """The ``model.*`` settings in a ``summary.json`` (``config.model``) or a JSON object of them,
    read as a bounded regular file (a FIFO or a directory named by mistake is refused at once)."""
    try:
        raw = read_regular(path, SETTINGS_LIMIT)
    except OSError as e:
        raise ValueError(
            f"--model-config {path} cannot be read: {e.strerror or e}; give a run's summary.json"
        ) from None
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"--model-config {path} cannot be read as JSON: {e}") from None
    rec = data.get("config", {}).get("model") if isinstance(data, dict) and "config" in data else data
    if not isinstance(rec, dict):
        raise ValueError(f"--model-config {path} holds no model settings (a summary.json or a JSON object)")
    return rec


def _settings_file(path: Path) -> Any:
    """The :class:`~zeropp.models.HFConfig` of a settings file (see :func:`_model_settings`)."""
    from zeropp.models.hf_export import hf_config_from_record

    return hf_config_from_record(_model_settings(path), path)


def main(argv: list[str] | None = None) -> None:
    from zeropp.models.hf_export import LORA_FORMATS, ExportError, MissingModelConfig, export_pretrained

    ap = argparse.ArgumentParser(prog="python -m experiments.export", description=__doc__.split("\n\n")[0])
    ap.add_argument("source", type=path_arg, help="a run directory (with checkpoints/) or a checkpoint directory")
    ap.add_argument("out_dir", type=path_arg, help="the new directory to write (must not exist, or be empty)")
    ap.add_argument(
        "--lora-format",
        choices=LORA_FORMATS,
        default="merged",
        help="LoRA runs: fold the adapters into the weights (merged), or write a peft adapter in <out dir>/adapter",
    )
    ap.add_argument(
        "--model-config",
        type=Path,
        default=None,
        help="the model settings (a summary.json, or a JSON object of model.* keys) for a checkpoint that records none",
    )
    a = ap.parse_args(argv)
    try:
        given = _settings_file(a.model_config) if a.model_config is not None else None
        try:
            out = export_pretrained(a.source, a.out_dir, lora_format=a.lora_format, model_config=given)
        except MissingModelConfig:
            summary = a.source / "summary.json"  # a run directory's record of its settings
            if given is not None or not summary.is_file():
                raise
            cfg = _settings_file(summary)
            out = export_pretrained(a.source, a.out_dir, lora_format=a.lora_format, model_config=cfg)
    except (ExportError, ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except OutputWriteError as e:  # the system refused the write (a full disk): not the command line's fault
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    info = json.loads((out / "zeropp_export.json").read_text())
    print(
        f"wrote {out} from the checkpoint of step {info['step']} (AutoModelForCausalLM.from_pretrained({str(out)!r}))"
    )
    note = _not_the_end(a.source, info)
    if note:
        print(f"warning: {note}", file=sys.stderr)
    skipped = info.get("tokenizer_skipped") or {}
    if skipped:  # model.pretrained's tokenizer, or part of it, is not in the export
        why = "; ".join(f"{name}: {reason}" for name, reason in skipped.items())
        print(f"warning: tokenizer files of model.pretrained not copied into {out} ({why})", file=sys.stderr)


def _not_the_end(source: Path, info: dict[str, Any]) -> str | None:
    """Why the exported checkpoint is not the end of its run, if it is not: the run diverged (its
    ``summary.json`` says so; the export is its last good checkpoint), or it stopped before
    ``train.steps`` (interrupted, failed, or still running)."""
    step, steps = info.get("step"), info.get("train_steps")
    try:
        summary = json.loads(read_regular(source / "summary.json", SETTINGS_LIMIT))
    except (OSError, ValueError):
        summary = None
    if isinstance(summary, dict) and summary.get("status") == "diverged":
        at = (summary.get("divergence") or {}).get("step")
        return f"the run diverged at step {at}; this is its last good checkpoint, of step {step}"
    if isinstance(step, int) and isinstance(steps, int) and step < steps:
        return (
            f"the run was to train {steps} steps (train.steps) and this checkpoint is of step {step}: "
            "it was stopped or failed before its end, or is still running"
        )
    return None


def cli() -> NoReturn:
    """The command: :func:`main`, ended by ``launch.command.run_command`` (Ctrl-C or a failed world
    is one ``error:`` line and the shell's exit status, never a traceback)."""
    run_command(main)


if __name__ == "__main__":
    cli()
