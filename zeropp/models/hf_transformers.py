"""The ``transformers`` config object of an :class:`~zeropp.models.hf_config.HFConfig`: built
from its sizes, read from ``model.pretrained``'s directory, or rebuilt from the plain record a
checkpoint keeps (:func:`recorded_config`), and the differences between such a record and the
settings now (:func:`config_differences`, what a resume checks)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from .hf_config import _DROPOUT, _HF_KEYS, INSTALL_HINT, HFConfig, _resolved, size_mismatch


def require_transformers() -> Any:
    """The ``transformers`` module, or an ImportError that says how to install the extra."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            f"Hugging Face models (model=hf, zeropp.models.hf) need the optional extra: {INSTALL_HINT} "
            f"(transformers is not installed: {e})"
        ) from e
    return transformers


def hf_model_config(cfg: HFConfig, recorded: Mapping[str, Any] | None = None) -> Any:
    """The ``transformers`` config object of ``cfg`` (dropout 0, no KV cache). With
    ``cfg.pretrained`` it is the checkpoint's own (its sizes were checked against ``cfg``; its other
    settings, e.g. norm epsilon or rotary base, are kept), with the same three changes. With
    ``recorded`` (what :func:`recorded_config` gave when the model was built, as a run's checkpoint
    keeps it) it is that one, whatever ``cfg.pretrained`` names now: plain attributes, nothing that
    could load code (an ``auto_map`` is dropped)."""
    tf = require_transformers()
    run = {
        **dict.fromkeys(_DROPOUT[cfg.hf_config], 0.0),
        "use_cache": False,
        "attn_implementation": cfg.attn_implementation,
    }
    cls = {"gpt2": tf.GPT2Config, "llama": tf.LlamaConfig}[cfg.hf_config]
    if recorded is not None:
        if recorded.get("model_type") != cfg.hf_config:
            raise ValueError(
                f"the recorded transformers config is of a {recorded.get('model_type')!r} model, "
                f"not hf_config={cfg.hf_config!r}"
            )
        wrong = size_mismatch(cfg, recorded)
        if wrong:
            raise ValueError(f"the recorded transformers config has {', '.join(wrong)}, which these settings do not")
        return cls.from_dict({k: v for k, v in recorded.items() if k not in ("auto_map", "_name_or_path")}, **run)
    if cfg.pretrained is not None:  # keyword arguments of from_pretrained override the saved attributes
        return tf.AutoConfig.from_pretrained(str(Path(cfg.pretrained).expanduser()), local_files_only=True, **run)
    keys = _HF_KEYS[cfg.hf_config]
    sizes = {keys[f]: v for f, v in _resolved(cfg, {f: getattr(cfg, f) for f in keys}).items()}
    return cls(**sizes, **run, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def recorded_config(cfg: HFConfig) -> dict[str, Any]:
    """``hf_model_config(cfg)`` as plain JSON values, for a checkpoint to keep: the export rebuilds
    the model from it, so a run from ``cfg.pretrained`` exports the model it trained (norm epsilon,
    rotary base, ...) even where that directory is gone or now holds another model."""
    return json.loads(hf_model_config(cfg).to_json_string(use_diff=False))


_BOOKKEEPING = (
    "transformers_version",
    "_name_or_path",
    "architectures",
    "dtype",
    "torch_dtype",
    "auto_map",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "decoder_start_token_id",
)
"""Keys of a recorded config that do not change the model's computation (special-token ids are
the tokenizer's and generation's, not the forward's: a GPT-2 directory names 50256, a config
built from settings none)."""


def config_differences(cfg: HFConfig, recorded: Mapping[str, Any]) -> list[str]:
    """``key=recorded value (now value)`` for each attribute of the ``transformers`` config ``cfg``
    builds now that differs from ``recorded`` (:func:`recorded_config` of the model a checkpoint was
    trained in); empty when they build the same model. Only attributes both have are compared: a
    ``transformers`` release that adds one is not a different model."""
    now = recorded_config(cfg)
    keys = sorted((set(now) & set(recorded)) - set(_BOOKKEEPING))
    return [f"{k}={recorded.get(k)!r} (now {now.get(k)!r})" for k in keys if now.get(k) != recorded.get(k)]
