"""Whether a run may start in its run directory: a fresh run must not land on an earlier run's
records (:func:`check_fresh_run_dir`, :class:`RunDirTaken`), and a resumed one must continue a
checkpoint of its own run (:func:`check_resumes_its_own`) and of its own model
(:func:`check_resumes_its_model`); :class:`RunFinished` / :class:`RunNeverSaved` tell a resumed
sweep which points to skip or to start. :meth:`~.config.RunConfig.check_run_dir` calls them
before any rank starts; the runner also reads :func:`saved_by` to name an interrupted run's
last checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from zeropp.models import GPTConfig, HFConfig
from zeropp.runtime import checkpoint_files

from .checks import ConfigError

__all__ = [
    "MODEL_KEYS_FREE_ON_RESUME",
    "RunDirTaken",
    "RunFinished",
    "RunNeverSaved",
    "check_fresh_run_dir",
    "check_resumes_its_model",
    "check_resumes_its_own",
    "run_records",
    "saved_by",
]


def saved_by(version: Path) -> str | None:
    """The run directory that saved checkpoint folder ``version`` (``run_dir`` of the extra the
    runner saves with it), or None: not recorded (saved before it was), or unreadable."""
    try:
        extra = checkpoint_files.read_meta(version).get("extra")
    except (OSError, ValueError):
        return None
    by = extra.get("run_dir") if isinstance(extra, dict) else None
    return by if isinstance(by, str) else None


def check_resumes_its_own(ckpt: Path, run_dir: Path) -> None:
    """With ``resume=true``: in a checkpoint directory shared by several runs (one
    ``train.checkpoint_dir`` for every point of a sweep), ``LATEST`` names the last save of any of
    them; when this run saved there too but another run saved the newest checkpoint, resuming would
    continue the other run's weights under this run's name and settings: refused, naming both.
    A run resuming from checkpoints it never saved to (another run's, on purpose) passes."""
    this = str(run_dir.resolve())
    if Path(ckpt).resolve().is_relative_to(this):
        return  # the run's own folder (the default, <run dir>/checkpoints): not shared, whatever path saved it
    try:
        newest = checkpoint_files.latest(ckpt)
    except (OSError, ValueError):
        return  # the ranks' load names the problem precisely
    by = saved_by(newest)
    if by is None or by == this:
        return
    try:
        own = sorted(
            (d for d in ckpt.iterdir() if checkpoint_files.NAME.fullmatch(d.name) and saved_by(d) == this),
            key=lambda d: checkpoint_files.version_step(d.name),
        )
    except OSError:
        return
    if own:
        raise ConfigError(
            f"invalid config: resume=true, but the newest checkpoint in {ckpt} ({newest.name}) was saved by the "
            f"run in {by}, not by this run ({this}, whose newest there is {own[-1].name}): the directory is shared "
            "(train.checkpoint_dir), and resuming would continue that other run's weights here. Give each run its "
            "own train.checkpoint_dir (the default is <run dir>/checkpoints), or resume the other run in its own "
            "directory"
        )


MODEL_KEYS_FREE_ON_RESUME = ("attn_implementation", "pretrained")
"""``model.*`` keys a resumed run may change: the attention kernel, and where the weights of a
fresh run came from (a resume takes them from the checkpoint). Every other key shapes the model."""


def check_resumes_its_model(
    newest: Path, model: Mapping[str, Any], built: GPTConfig | HFConfig | None = None, tp: int = 1
) -> None:
    """With ``resume=true``: the model settings the newest checkpoint recorded (``extra["model"]``)
    must be this run's, but for :data:`MODEL_KEYS_FREE_ON_RESUME`. Another model (a LoRA rank, a
    size, tied embeddings, the architecture) either fails on every rank after they start, with the
    engine's message about units, or, where the shapes happen to agree, trains the checkpoint under
    settings it was not trained with and records those for the export: refused here, naming the keys.
    For a Hugging Face model (``built``) the ``transformers`` config the checkpoint recorded must
    also be the one these settings build: ``model.pretrained`` is read again by every rank, and a
    directory that now holds another model, or a resume without it, would change the norm epsilon,
    rotary base, ... of the model the weights were trained in. An engine checkpoint's
    ``topology.tp`` must be ``tp`` (its pieces load at the same tp only)."""
    try:
        meta = checkpoint_files.read_meta(newest)
    except (OSError, ValueError):
        return  # the ranks' load names the problem precisely
    extra = meta.get("extra") or {}
    saved_tp = meta.get("tp", 1)
    hf = model.get("kind") == "hf"  # (an export, and a fresh run from it, are Hugging Face models' only)
    if meta.get("kind", "engine") == "engine" and isinstance(saved_tp, int) and saved_tp != tp:
        export = (
            ", or export it (python -m experiments.export) and start a fresh run from its weights (model.pretrained=)"
            if hf
            else ""
        )
        raise ConfigError(
            f"invalid config: resume=true, but the checkpoint {newest} was saved with topology.tp={saved_tp} and "
            f"this run has topology.tp={tp}: a tensor-parallel checkpoint resumes at the same tp (any data-parallel "
            f"size). Resume with topology.tp={saved_tp}{export}"
        )
    saved = extra.get("model")
    if not isinstance(saved, dict):
        return  # saved before the settings were recorded
    # keys both records have: a setting added to the model configs since the checkpoint was saved is not a change
    keys = ["kind"] if saved.get("kind") != model.get("kind") else sorted(set(saved) & set(model))
    changed = [
        f"model.{k}={saved.get(k)!r} (now {model.get(k)!r})"
        for k in keys
        if k not in MODEL_KEYS_FREE_ON_RESUME and saved.get(k) != model.get(k)
    ]
    if changed:
        raise ConfigError(
            f"invalid config: resume=true, but the checkpoint {newest} is of another model: it was saved with "
            f"{', '.join(changed)}. Resume with the saving run's model settings, or start a fresh run "
            "elsewhere" + (" (model.pretrained=<an export of it> starts one from its weights)" if hf else "")
        )
    recorded = extra.get("transformers_config")
    if isinstance(built, HFConfig) and isinstance(recorded, dict):
        from zeropp.models.hf import config_differences

        try:
            differ = config_differences(built, recorded)
        except ImportError as e:  # installed but broken
            raise ConfigError(f"invalid config: model=hf cannot import transformers: {e}") from None
        if differ:
            where = (
                f"model.pretrained={built.pretrained}" if built.pretrained else "these settings (no model.pretrained)"
            )
            raise ConfigError(
                f"invalid config: resume=true, but the checkpoint {newest} was trained in a model whose transformers "
                f"config differs from the one {where} builds: {', '.join(differ[:6])}. Resume with model.pretrained "
                "naming a directory with the checkpoint's config (python -m experiments.export writes one from it)"
            )


class RunFinished(ConfigError):
    """``resume=true`` of a run whose newest checkpoint is of its last step (:meth:`RunConfig.check_run_dir`).
    A resumed sweep skips such a point (its run is done) instead of recording it as failed."""


class RunNeverSaved(ConfigError):
    """``resume=true`` where no checkpoint is and no run left records (:meth:`RunConfig.check_run_dir`).
    A resumed sweep starts such a point fresh (it never started, or stopped before writing
    anything): resuming a sweep means finishing every point, and there is nothing of it to lose."""


class RunDirTaken(ConfigError):
    """A fresh run would land on an earlier run's records (:func:`check_fresh_run_dir`). A sweep
    stops at it instead of recording a failed job (whose ``failed.json`` would go into that
    earlier run's directory)."""


def run_records(run_dir: Path) -> list[Path]:
    """What makes ``run_dir`` an earlier run's: its ``summary.json``, a non-empty ``metrics.jsonl``."""
    held = [run_dir / "summary.json"] if (run_dir / "summary.json").exists() else []
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        held.append(metrics)
    return held


def check_fresh_run_dir(run_dir: Path, *, key: str, resumable: bool) -> None:
    """Raise :class:`RunDirTaken` when ``run_dir`` holds an earlier run's records: a fresh run there
    would truncate its ``metrics.jsonl``, replace its ``summary.json`` and, saving into the default
    ``<run dir>/checkpoints``, move its ``LATEST`` (a later ``resume=true`` would continue the wrong
    run). ``resumable``: that run left a checkpoint, so ``resume=true`` is offered. A
    ``train.checkpoint_dir`` shared by several runs on purpose is not a record: each run keeps its
    own newest checkpoint there (``checkpoint_files``)."""
    held = run_records(run_dir)
    if held:
        resume = "pass resume=true to continue it from its latest checkpoint, or " if resumable else ""
        raise RunDirTaken(
            f"invalid config: {run_dir} already holds a run ({', '.join(p.name for p in held)}), which this "
            f"fresh run would overwrite; {resume}choose another {key}"
        )
