"""The settings of a Hugging Face causal LM (:class:`HFConfig`) and their mapping onto the
``transformers`` config keys.

:class:`HFConfig` needs nothing beyond the standard library (``transformers`` is imported only
when a model is built), so the runner can validate ``model=hf`` settings anywhere; its size fields
share their names with :class:`~zeropp.models.GPTConfig`. The model itself is ``hf.py``'s, the
``transformers`` config object ``hf_transformers.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from .hf_pretrained import read_saved_config

HF_ARCHS = ("gpt2", "llama")
"""Values of :attr:`HFConfig.hf_config`: the ``transformers`` config classes this module maps."""

INSTALL_HINT = 'pip install -e ".[hf]"'

# HFConfig field -> the transformers config attribute of each architecture (save_pretrained's config.json keys)
_HF_KEYS: dict[str, dict[str, str]] = {
    "gpt2": {
        "vocab_size": "vocab_size",
        "seq_len": "n_positions",
        "d_model": "n_embd",
        "n_layers": "n_layer",
        "n_heads": "n_head",
        "intermediate_size": "n_inner",
        "tie_embeddings": "tie_word_embeddings",
    },
    "llama": {
        "vocab_size": "vocab_size",
        "seq_len": "max_position_embeddings",
        "d_model": "hidden_size",
        "n_layers": "num_hidden_layers",
        "n_heads": "num_attention_heads",
        "n_kv_heads": "num_key_value_heads",
        "intermediate_size": "intermediate_size",
        "tie_embeddings": "tie_word_embeddings",
    },
}
_DROPOUT = {
    "gpt2": ("resid_pdrop", "embd_pdrop", "attn_pdrop", "summary_first_dropout"),
    "llama": ("attention_dropout",),
}


@dataclass(frozen=True, kw_only=True)
class HFConfig:
    """A Hugging Face causal LM: which architecture, its shape, and optionally a local checkpoint.
    Frozen so it can be hashed, logged and compared."""

    hf_config: str = "gpt2"
    """Architecture, i.e. the ``transformers`` config class: ``gpt2`` (GPT2Config) or ``llama`` (LlamaConfig)."""
    vocab_size: int = 256
    """Number of token ids; 256 matches the runner's byte-level data."""
    seq_len: int = 64
    """Longest sequence (GPT-2 ``n_positions``, Llama ``max_position_embeddings``)."""
    d_model: int = 64
    """Hidden width (GPT-2 ``n_embd``, Llama ``hidden_size``)."""
    n_layers: int = 2
    """Decoder layers, the ZeRO-3 gather units (GPT-2 ``n_layer``, Llama ``num_hidden_layers``)."""
    n_heads: int = 2
    """Attention heads; must divide ``d_model`` (GPT-2 ``n_head``, Llama ``num_attention_heads``)."""
    intermediate_size: int | None = None
    """MLP hidden width (GPT-2 ``n_inner``, Llama ``intermediate_size``); None: ``4 * d_model``."""
    n_kv_heads: int | None = None
    """Llama only: key/value heads (grouped-query attention), must divide ``n_heads``; None: ``n_heads``."""
    tie_embeddings: bool = False
    """Share the token embedding with the output layer (``tie_word_embeddings``; GPT-2's own default is
    True). Off by default: the engine keeps one parameter in one communication unit."""
    attn_implementation: str = "sdpa"
    """``transformers`` attention kernel: ``sdpa`` (torch's scaled_dot_product_attention) or ``eager``."""
    lora_rank: int = 0
    """LoRA fine-tuning (``zeropp.models.lora.apply_lora``): > 0 gives every linear layer of the decoder
    layers (GPT-2's ``Conv1D`` projections, Llama's q/k/v/o and MLP projections) a trainable
    rank-``lora_rank`` adapter (alpha = 2 * rank) and freezes the rest; 0 (default) trains everything."""
    pretrained: str | None = None
    """A LOCAL ``save_pretrained`` directory to load weights from (``local_files_only``; never a hub
    name, nothing is downloaded). Its config.json must have this config's architecture and sizes."""

    def __post_init__(self) -> None:
        if self.hf_config not in HF_ARCHS:
            raise ValueError(
                f"HFConfig.hf_config={self.hf_config!r} is not supported; choose one of {', '.join(HF_ARCHS)}"
            )
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "intermediate_size", "n_kv_heads"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"HFConfig.{name} must be an integer >= 1, got {v!r}")
        if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise ValueError(f"HFConfig.lora_rank must be an integer >= 0 (0: no LoRA), got {self.lora_rank!r}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"HFConfig: n_heads={self.n_heads} must divide d_model={self.d_model}; "
                "pick d_model as a multiple of n_heads"
            )
        if self.n_kv_heads is not None:
            if self.hf_config != "llama":
                raise ValueError(
                    f"HFConfig.n_kv_heads={self.n_kv_heads} applies to hf_config=llama only "
                    f"(hf_config={self.hf_config!r} has one key/value head per query head); remove it"
                )
            if self.n_heads % self.n_kv_heads:
                raise ValueError(f"HFConfig: n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        if self.hf_config == "llama" and (self.d_model // self.n_heads) % 2:
            raise ValueError(
                f"HFConfig: the head size d_model / n_heads = {self.d_model // self.n_heads} must be even "
                "for hf_config=llama (rotary embeddings rotate pairs of channels)"
            )
        kv = self.kv_heads * (self.d_model // self.n_heads)  # llama's k/v projections are the narrowest
        narrowest = min(self.d_model, self.ffn_size, kv if self.hf_config == "llama" else self.d_model)
        if self.lora_rank > narrowest:
            raise ValueError(
                f"HFConfig.lora_rank={self.lora_rank} exceeds the narrowest adapted layer ({narrowest} wide): "
                f"an adapter's update has rank at most {narrowest}, so a larger rank only adds parameters; "
                f"choose lora_rank <= {narrowest}"
            )
        if self.attn_implementation not in ("sdpa", "eager"):
            raise ValueError(f"HFConfig.attn_implementation={self.attn_implementation!r}; choose sdpa or eager")
        if self.pretrained is not None:
            self._check_pretrained(Path(self.pretrained).expanduser())

    def _check_pretrained(self, path: Path) -> None:
        """The directory holds a checkpoint of this architecture and these sizes (its config.json),
        and no peft adapter that loading it would leave out."""
        for adapter in (path, path / "adapter"):  # a peft adapter itself, or beside its base (the export's layout)
            if (adapter / "adapter_config.json").exists():
                raise ValueError(
                    f"HFConfig.pretrained={str(path)!r} holds a peft adapter ({adapter / 'adapter_config.json'}), "
                    "which is not loaded: the run would start from the base model without "
                    "it. Give a directory with the adapter merged (python -m experiments.export "
                    "--lora-format merged, or peft's merge_and_unload + save_pretrained)"
                )
        if not (path / "config.json").exists():
            what = "has no config.json" if path.is_dir() else "does not exist"
            raise ValueError(
                f"HFConfig.pretrained={str(path)!r} {what}; give a local directory written by "
                "save_pretrained (nothing is downloaded), or leave it unset for random weights"
            )
        try:
            saved = read_saved_config(path / "config.json")
        except ValueError as e:
            raise ValueError(f"HFConfig.pretrained={str(path)!r}: {e}") from None
        kind = saved.get("model_type")
        if kind not in HF_ARCHS:
            raise ValueError(
                f"HFConfig.pretrained={str(path)!r} holds a {kind!r} model (config.json's model_type), "
                f"which zeropp does not build; it supports {', '.join(HF_ARCHS)}"
            )
        quant = saved.get("quantization_config")
        if quant is not None:  # transformers would load it through a quantization library, or fail in every rank
            method = quant.get("quant_method") if isinstance(quant, dict) else quant
            raise ValueError(
                f"HFConfig.pretrained={str(path)!r} holds a quantized model (config.json's quantization_config: "
                f"{method}); zeropp trains float weights and quantizes on the wire itself: give the "
                "unquantized checkpoint"
            )
        if kind != self.hf_config:
            raise ValueError(
                f"HFConfig.pretrained={str(path)!r} holds a {kind!r} model but "
                f"hf_config={self.hf_config!r}; set hf_config to match"
            )
        wrong = size_mismatch(self, saved)
        if wrong:
            raise ValueError(
                f"HFConfig.pretrained={str(path)!r} does not match this config; the checkpoint has "
                f"{', '.join(wrong)}: set these (model.<name>=... in the runner)"
            )

    def with_(self, **changes: Any) -> HFConfig:
        return replace(self, **changes)

    @property
    def ffn_size(self) -> int:
        """The MLP hidden width actually built."""
        return self.intermediate_size or 4 * self.d_model

    @property
    def kv_heads(self) -> int:
        """Key/value heads actually built."""
        return self.n_kv_heads or self.n_heads

    def num_params(self) -> int:
        """Exact parameter count of the built model (tied embeddings counted once, LoRA adapters
        included: ``lora_rank * (in + out)`` per adapted layer)."""
        v, t, d, h, n, r = self.vocab_size, self.seq_len, self.d_model, self.ffn_size, self.n_layers, self.lora_rank
        head = 0 if self.tie_embeddings else d * v
        if self.hf_config == "gpt2":  # LayerNorms and linear layers with biases, learned positions
            block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * h + h) + (h * d + d)
            block += r * ((d + 3 * d) + (d + d) + (d + h) + (h + d))
            return v * d + t * d + n * block + 2 * d + head
        kv = self.kv_heads * (d // self.n_heads)  # llama: RMSNorms, bias-free linears, rotary positions
        block = 2 * d + d * d + 2 * d * kv + d * d + 3 * d * h
        block += r * (2 * (d + d) + 2 * (d + kv) + 2 * (d + h) + (h + d))  # q, o; k, v; gate, up; down
        return v * d + n * block + d + head


def size_mismatch(cfg: HFConfig, saved: Mapping[str, Any]) -> list[str]:
    """``field=value`` for each size of ``cfg`` that the ``transformers`` config dict ``saved`` (a
    ``config.json``) has otherwise; empty when they describe the same shapes."""
    want = _resolved(cfg, {field: getattr(cfg, field) for field in _HF_KEYS[cfg.hf_config]})
    wrong = []
    for field, key in _HF_KEYS[cfg.hf_config].items():
        have = saved.get(key)
        if field == "intermediate_size" and have is None:
            have = 4 * saved.get(_HF_KEYS[cfg.hf_config]["d_model"], 0)
        if field == "n_kv_heads" and have is None:
            have = saved.get("num_attention_heads")
        if field == "tie_embeddings" and have is None:
            have = cfg.hf_config == "gpt2"  # the config classes' defaults
        if have != want[field]:
            wrong.append(f"{field}={have}")
    return wrong


def _resolved(cfg: HFConfig, values: dict[str, Any]) -> dict[str, Any]:
    out = dict(values)
    out["intermediate_size"] = cfg.ffn_size
    if "n_kv_heads" in out:
        out["n_kv_heads"] = cfg.kv_heads
    return out
