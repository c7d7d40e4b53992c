"""A checkpoint of a Hugging Face model's run, out as a ``save_pretrained`` directory.

:func:`export_pretrained` reads the latest checkpoint of a run in ONE process, whatever the world
size, stage, topology or trainer that saved it (``zeropp.runtime.read_consolidated``: DCP reads
every rank's pieces, tensor-parallel pieces are merged, nothing in the files can run code), rebuilds
the ``transformers`` model from the model settings the runner records in the checkpoint
(``meta.json``'s ``extra["model"]``, what ``model.*`` was, and ``extra["transformers_config"]``, the
``transformers`` config the ranks built, so a run from ``model.pretrained`` needs that directory no
more), and writes it with the model's own
``save_pretrained`` (safetensors weights and ``config.json``), so
``AutoModelForCausalLM.from_pretrained(out_dir)`` gives the trained model's logits exactly (fp32).
A run from ``model.pretrained`` gets that directory's tokenizer files beside the model when the
directory still has them (``hf_tokenizer.py``: data files only, bounded, no symlink out followed).

LoRA (``model.lora_rank > 0``): ``lora_format="merged"`` (default) folds each adapter into its
base weight, ``W + (alpha / r) * B @ A`` (transposed for GPT-2's ``Conv1D``), and writes a plain
model; ``lora_format="peft"`` writes the *base* weights as the plain model in ``out_dir`` and the
adapters as a ``peft`` adapter directory in ``out_dir/adapter`` (written by ``peft`` itself:
``get_peft_model`` + ``save_pretrained``; ``PeftModel.from_pretrained(base, out_dir / "adapter")``
loads it). Our LoRA stays our own rather than ``peft``'s: :class:`~zeropp.models.lora.LoRALinear`
*is* the ``nn.Linear`` it adapts and reuses its ``weight`` / ``bias`` Parameters under their
original names, which is what the engine's flat units, ``quantize_frozen`` and the tensor-parallel
plans (which match ``q_proj`` etc. as ``nn.Linear``) rely on; ``peft`` wraps the layer
(``q_proj.base_layer.weight``), which renames the parameters and hides the ``nn.Linear`` from
those, and it also adds ``accelerate`` to the training path. The adapters' math is the same
(``B`` zero-initialised, scale ``alpha / r``), so converting at the export is exact.

Refused with :class:`ExportError`, before anything is written: an ``out_dir`` that exists and is
not an empty directory (nothing we did not write is overwritten or deleted), a checkpoint whose
model settings are missing (saved before they were recorded, or not by the runner: pass
``model_config``) or are not a Hugging Face model (``model.kind=gpt``), a state that does not
match the model (a parameter missing or left over). The directory is written under a temporary
name beside ``out_dir`` and renamed into place at the end, so a failed export leaves no partial
``out_dir``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..output_files import OutputWriteError, creation_refused, nearest_existing
from .hf import HFConfig, hf_model_config, model_class
from .hf_pretrained import tied_names
from .hf_tokenizer import copy_tokenizer

LORA_FORMATS = ("merged", "peft")
"""Values of ``lora_format``: adapters folded into the base weights, or a ``peft`` adapter directory."""

ADAPTER_DIR = "adapter"
"""Where ``lora_format="peft"`` writes the adapter, inside ``out_dir``."""

PEFT_HINT = 'pip install peft (or pip install -e ".[hf]")'


class ExportError(ValueError):
    """The export cannot be done as asked; the message says what to change. Nothing was written."""


class MissingModelConfig(ExportError):
    """The checkpoint records no model settings and none were given."""


def find_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint directory of ``path``: ``path`` itself when it holds ``LATEST``, else the run
    directory's ``checkpoints/`` (the runner's default ``train.checkpoint_dir``)."""
    p = Path(path).expanduser()
    if (p / "LATEST").is_file():
        return p
    if (p / "checkpoints" / "LATEST").is_file():
        return p / "checkpoints"
    what = "does not exist" if not p.exists() else "holds no LATEST file, nor does its checkpoints/"
    raise ExportError(
        f"{p} {what}: give a checkpoint directory (one with LATEST) or the run directory of a run "
        f"that saved checkpoints (train.checkpoint_every > 0; with train.checkpoint_dir set, give that directory)"
    )


def model_config_of(meta: dict, where: str | os.PathLike) -> HFConfig:
    """The :class:`HFConfig` the runner recorded in a checkpoint's ``meta.json`` (``extra["model"]``)."""
    rec = (meta.get("extra") or {}).get("model")
    if not isinstance(rec, dict):
        raise MissingModelConfig(
            f"the checkpoint in {where} records no model settings (it was saved before they were "
            f"recorded, or not by the runner): pass the model's settings (model_config=HFConfig(...), "
            f"or --model-config <the run's summary.json>)"
        )
    return hf_config_from_record(rec, where)


def hf_config_from_record(rec: dict, where: str | os.PathLike) -> HFConfig:
    """An :class:`HFConfig` from a run's ``model`` settings (``{"kind": "hf", ...}``, as the runner
    writes them in a checkpoint and in ``summary.json``'s ``config.model``)."""
    kind = rec.get("kind", "hf")
    if kind != "hf":
        raise ExportError(
            f"{where} holds a model.kind={kind} model (the built-in GPT), which transformers cannot "
            f"load: only runs with model=hf export to a Hugging Face directory (for plain weights use "
            f"zeropp.runtime.export_consolidated)"
        )
    fields = {f.name for f in dataclasses.fields(HFConfig)}
    unknown = sorted(set(rec) - fields - {"kind"})
    if unknown:
        raise ExportError(f"the model settings of {where} have keys HFConfig does not know: {unknown}")
    try:
        return HFConfig(**{k: v for k, v in rec.items() if k != "kind"})
    except (TypeError, ValueError) as exc:
        raise ExportError(f"the model settings of {where} do not build a model: {exc}") from exc


def check_out_dir(out_dir: str | os.PathLike) -> Path:
    """``out_dir`` as a Path, refused when it exists and is not an empty directory."""
    out = Path(out_dir).expanduser()
    if out.is_symlink():  # the final rename would replace the link itself, not write where it points
        raise ExportError(
            f"{out} is a symlink (to {os.readlink(out)}); the export writes a new directory, not through a "
            "link: name the directory itself, or a new one"
        )
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} exists and is not a directory: choose a new directory for the export")
    if out.is_dir() and any(out.iterdir()):
        raise ExportError(
            f"{out} exists and is not empty: the export never overwrites or deletes files it did not "
            f"write; choose a new directory (or empty this one yourself)"
        )
    # the export is written in a temporary folder beside out_dir, then renamed: where that folder
    # goes is checked now, before the checkpoint is read, not when the first file is written
    base = nearest_existing(out.parent)
    if not base.is_dir():
        raise ExportError(f"{out} cannot be created: {base} is not a directory; choose a new directory for the export")
    err = creation_refused(base)
    if err is not None:
        raise ExportError(
            f"{out} cannot be created: {base} does not let this process create files ({err.strerror or err}); "
            "choose a directory you can write to"
        )
    return out


def export_pretrained(
    checkpoint_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    lora_format: str = "merged",
    model_config: HFConfig | None = None,
) -> Path:
    """Write the latest checkpoint under ``checkpoint_dir`` (a checkpoint directory, or a run
    directory with ``checkpoints/``) to ``out_dir`` as a ``save_pretrained`` directory; returns
    ``out_dir``. ``lora_format``: see the module docstring. ``model_config``: the model's settings
    when the checkpoint does not record them (else the recorded ones are used; giving both is an
    error when they differ)."""
    if lora_format not in LORA_FORMATS:
        raise ExportError(f"lora_format={lora_format!r}: choose one of {', '.join(LORA_FORMATS)}")
    if lora_format == "peft":
        _require_peft()  # before the checkpoint is read and the base model written, not after
    out = check_out_dir(out_dir)
    src = find_checkpoint(checkpoint_dir)
    from zeropp.runtime.checkpoint_files import latest, read_meta
    from zeropp.runtime.consolidate import read_consolidated

    try:
        extra = read_meta(latest(src)).get("extra") or {}
    except (OSError, ValueError) as exc:
        raise ExportError(f"cannot read the checkpoint in {src}: {exc}") from exc
    recorded, tconf = extra.get("model"), extra.get("transformers_config")
    tconf = tconf if isinstance(tconf, dict) else None
    pretrained = (model_config.pretrained if model_config is not None else None) or (  # its tokenizer is copied
        recorded.get("pretrained") if isinstance(recorded, dict) else None
    )
    if tconf is not None:  # the model is rebuilt from it: model.pretrained's directory is not read again
        recorded = {**recorded, "pretrained": None} if isinstance(recorded, dict) else recorded
        model_config = model_config.with_(pretrained=None) if model_config is not None else None
    if model_config is None:
        cfg = model_config_of({"extra": {"model": recorded}}, src)
    else:
        cfg = model_config
        if isinstance(recorded, dict) and hf_config_from_record(recorded, src) != cfg:
            raise ExportError(
                f"model_config differs from the model settings recorded in {src}; leave it unset "
                f"(the recorded ones are used)"
            )
    try:
        state, meta = read_consolidated(src)
    except (OSError, ValueError) as exc:
        raise ExportError(f"cannot read the checkpoint in {src}: {exc}") from exc
    if lora_format == "peft" and not cfg.lora_rank:
        raise ExportError(f"lora_format=peft needs a LoRA run (model.lora_rank > 0); {src} has no adapters")
    weights = _hf_state(state, src)
    try:
        conf = hf_model_config(cfg, tconf)
    except (TypeError, ValueError) as exc:
        raise ExportError(f"{src}: {exc}; give the model settings of the run that saved it") from exc
    adapters = _lora_layers(cfg, conf) if cfg.lora_rank else {}
    base = _split_lora(weights, adapters, merge=lora_format == "merged", where=src)
    hf = _plain_model(cfg, conf, base, src)
    tmp = out.with_name(f".{out.name}.export-tmp{os.getpid()}")
    try:
        tmp.mkdir(parents=True)
        hf.save_pretrained(tmp)
        tokenizer, skipped = copy_tokenizer(pretrained if isinstance(pretrained, str) else None, tmp)
        if lora_format == "peft":
            _save_peft(hf, weights, adapters, tmp / ADAPTER_DIR, final=out)
        run = extra.get("run")
        run = run if isinstance(run, dict) else {}
        info = {
            "checkpoint": str(src.resolve()),
            "step": meta.get("step"),
            "train_steps": run.get("train.steps"),  # the run's length: a smaller step is not its end
            "lora_format": lora_format,
            "tokenizer_files": tokenizer,  # copied from model.pretrained's directory (hf_tokenizer.py)
            "tokenizer_skipped": skipped,
        }
        (tmp / "zeropp_export.json").write_text(json.dumps(info, indent=1) + "\n")
        if out.is_dir():
            out.rmdir()  # empty (checked above); fails, leaving it, if something appeared in it since
        os.replace(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)  # our own temporary directory only
        if isinstance(e, OSError) and not isinstance(e, OutputWriteError):  # a full disk, a quota
            raise OutputWriteError(
                f"cannot write the export to {out}: {e.strerror or e}; nothing was left there: free space or "
                "choose another out_dir, and run again"
            ) from e
        raise
    return out


def _hf_state(state: dict[str, torch.Tensor], where: Path) -> dict[str, torch.Tensor]:
    """The ``transformers`` model's own names: :class:`~zeropp.models.hf.HFCausalLM` keeps it as ``hf``."""
    foreign = sorted(k for k in state if not k.startswith("hf."))
    if foreign:
        raise ExportError(
            f"the checkpoint in {where} is not of a Hugging Face model (zeropp.models.HFCausalLM): it has "
            f"entries {foreign[:5]} outside hf.*"
        )
    return {k.removeprefix("hf."): v for k, v in state.items()}


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Adapter:
    """One adapted layer of the model (a :class:`~zeropp.models.lora.LoRALinear`)."""

    scaling: float
    """``alpha / rank``."""
    transposed: bool
    """GPT-2's ``Conv1D``: the base weight is ``[in, out]``."""
    rank: int
    alpha: float


def _lora_layers(cfg: HFConfig, conf: Any) -> dict[str, _Adapter]:
    """Module name -> adapter of every layer ``apply_lora`` adapts in ``cfg``'s model (whose
    ``transformers`` config is ``conf``), found by building it on the meta device (no memory, no
    weights) exactly as the training run did."""
    from .lora import LoRALinear, apply_lora

    with torch.device("meta"):
        hf = model_class(cfg)(copy.deepcopy(conf))
    apply_lora(hf, cfg.lora_rank)
    return {
        n: _Adapter(scaling=m.scaling, transposed=m.transposed, rank=m.rank, alpha=m.alpha)
        for n, m in hf.named_modules()
        if isinstance(m, LoRALinear)
    }


def _split_lora(
    weights: dict[str, torch.Tensor], adapters: dict[str, _Adapter], *, merge: bool, where: Path
) -> dict[str, torch.Tensor]:
    """The base model's state: without the adapters' ``lora_a`` / ``lora_b``, folded into the base
    weights when ``merge`` (``W + scaling * B @ A``, in float64 then cast back, so the result is
    the closest value of the weight's dtype)."""
    out = {k: v for k, v in weights.items() if not k.endswith((".lora_a", ".lora_b"))}
    have = {k.rsplit(".", 1)[0] for k in weights if k.endswith((".lora_a", ".lora_b"))}
    if have != set(adapters):
        raise ExportError(
            f"the checkpoint in {where} has LoRA adapters on {sorted(have)[:4]} but the model settings "
            f"put them on {sorted(adapters)[:4]} (model.lora_rank): the settings are not this run's"
        )
    if not merge:
        return out
    for name, ad in adapters.items():
        a, b = weights[f"{name}.lora_a"], weights[f"{name}.lora_b"]  # [r, in], [out, r]
        w = out[f"{name}.weight"]
        delta = (b.double() @ a.double()) * ad.scaling  # [out, in]
        out[f"{name}.weight"] = (w.double() + (delta.t() if ad.transposed else delta)).to(w.dtype)
    return out


def _plain_model(cfg: HFConfig, conf: Any, state: dict[str, torch.Tensor], where: Path) -> Any:
    """The ``transformers`` model (no adapters; its config ``conf``) holding ``state``: built on the
    meta device, its parameters then assigned from ``state`` (strictly: a missing or extra entry is
    an error)."""
    conf = copy.deepcopy(conf)
    conf.use_cache = True  # the run disables the KV cache; a shared model generates with it
    with torch.device("meta"):
        hf = model_class(cfg)(conf)
    want = set(hf.state_dict())
    # a tied weight may be saved under one of its names only (a frozen one, e.g. the embedding
    # of a LoRA run, is stored once): the others take it from there
    state = dict(state)
    for n, names in tied_names(hf).items():
        have = [a for a in names if a in state]
        if have and n not in state:
            state[n] = state[have[0]]
    # the engine saves every buffer; those the model does not persist (rotary frequencies) it
    # recomputes when built, so they are not part of the saved model
    transient = {n for n, _ in hf.named_buffers()} - want
    missing, extra = sorted(want - set(state)), sorted(set(state) - want - transient)
    if missing or extra:
        raise ExportError(
            f"the checkpoint in {where} does not match the {cfg.hf_config} model its settings describe: "
            f"missing {missing[:5]}, unexpected {extra[:5]}"
        )
    hf.load_state_dict({k: v for k, v in state.items() if k in want}, strict=True, assign=True)
    if cfg.tie_embeddings:
        hf.tie_weights()
    return hf.float().eval()


def _require_peft() -> Any:
    """The ``peft`` module, or the :class:`ExportError` that says how to install it."""
    try:
        import peft
    except ImportError as e:
        raise ExportError(f"lora_format=peft needs the peft package: {PEFT_HINT} ({e})") from e
    return peft


def _save_peft(
    base: nn.Module, weights: dict[str, torch.Tensor], adapters: dict[str, _Adapter], target: Path, *, final: Path
) -> None:
    """The adapters as a ``peft`` LoRA adapter directory, written by ``peft`` itself (our ``lora_a``
    is its ``lora_A`` ``[r, in]``, our ``lora_b`` its ``lora_B`` ``[out, r]``; GPT-2's ``Conv1D`` is
    ``fan_in_fan_out``)."""
    peft = _require_peft()
    first = next(iter(adapters.values()))
    conf = peft.LoraConfig(
        r=first.rank,
        lora_alpha=int(first.alpha) if first.alpha.is_integer() else first.alpha,
        target_modules=sorted(adapters),
        lora_dropout=0.0,
        bias="none",
        fan_in_fan_out=first.transposed,
        task_type="CAUSAL_LM",
    )
    model: Any = peft.get_peft_model(base, conf)
    with torch.no_grad():
        for name in adapters:
            layer = model.base_model.model.get_submodule(name)
            layer.lora_A["default"].weight.copy_(weights[f"{name}.lora_a"])
            layer.lora_B["default"].weight.copy_(weights[f"{name}.lora_b"])
    model.peft_config["default"].base_model_name_or_path = str(final.resolve())
    with warnings.catch_warnings():  # peft looks for the base's config at that path, which exists only once renamed
        warnings.filterwarnings("ignore", message="Could not find a config file", category=UserWarning)
        model.save_pretrained(str(target))
    model.unload()  # ``base`` back without the adapter layers


__all__ = [
    "ADAPTER_DIR",
    "LORA_FORMATS",
    "ExportError",
    "MissingModelConfig",
    "export_pretrained",
    "find_checkpoint",
    "hf_config_from_record",
]
