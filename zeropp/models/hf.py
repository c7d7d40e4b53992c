"""Hugging Face causal language models (GPT-2, Llama) behind the engine's model contract.

Why a wrapper: the runtime trains ``model(idx, targets) -> (logits, loss)`` and shards per
transformer block, found as ``model.blocks``. :func:`build_hf_model` builds a ``transformers``
model from its config class with random weights (seeded by the caller's ``torch.manual_seed``;
nothing is downloaded) or loads a local ``save_pretrained`` directory, and wraps it in
:class:`HFCausalLM`, whose ``blocks`` is the model's own decoder-layer ``ModuleList`` (not a second
registration, so parameter names stay the Hugging Face ones under ``hf.``) and whose loss is the
mean cross-entropy of the logits against ``targets`` exactly as :class:`~zeropp.models.GPT`
computes it. Our targets are already the next tokens, so the Hugging Face ``labels`` path (which
shifts by one position itself) is not used.

``transformers`` is an optional extra (``pip install -e ".[hf]"``), imported only when a model is
built; :class:`HFConfig` itself needs nothing beyond the standard library, so the runner can
validate ``model=hf`` settings anywhere. Its size fields share their names with
:class:`~zeropp.models.GPTConfig` (``vocab_size``, ``seq_len``, ``d_model``, ``n_layers``,
``n_heads``), so code that reads a model config's shape works on either.

Dropout is always 0 (also for a pretrained checkpoint): two runs with the same weights and data
are then bit-for-bit reproducible, which the parity tests rely on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .hf_pretrained import check_pretrained_weights, ignorable, read_saved_config

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


class HFCausalLM(nn.Module):
    """``model(idx, targets=None) -> (logits [B, T, V], loss or None)`` around a ``transformers``
    causal LM (``self.hf``); ``blocks`` is its decoder-layer ``ModuleList``."""

    def __init__(self, hf: nn.Module, cfg: HFConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.hf = hf

    @property
    def blocks(self) -> nn.ModuleList:
        """The decoder layers (GPT-2 ``transformer.h``, Llama ``model.layers``): the ZeRO-3 units."""
        base = self.hf.base_model
        layers = getattr(base, "h", None) if self.cfg.hf_config == "gpt2" else getattr(base, "layers", None)
        if not isinstance(layers, nn.ModuleList):
            raise RuntimeError(
                f"{type(self.hf).__name__} has no decoder-layer ModuleList where hf_config="
                f"{self.cfg.hf_config!r} keeps it"
            )
        return layers

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        _b, t = idx.shape  # [B, T] int64 token ids
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence length {t} exceeds HFConfig.seq_len={self.cfg.seq_len}")
        logits = self.hf(input_ids=idx, use_cache=False).logits  # [B, T, V]
        loss = None
        if targets is not None:  # targets are the next tokens already: no shift
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def model_class(cfg: HFConfig) -> Any:
    """The ``transformers`` causal-LM class of ``cfg.hf_config``."""
    tf = require_transformers()
    return {"gpt2": tf.GPT2LMHeadModel, "llama": tf.LlamaForCausalLM}[cfg.hf_config]


def check_pretrained(cfg: HFConfig) -> None:
    """``ValueError`` unless ``cfg.pretrained`` holds safetensors weights that are exactly the
    model's (``hf_pretrained.check_pretrained_weights``; reads headers, no tensor): what
    :func:`build_hf_model` checks, for a caller that refuses before starting ranks."""
    if cfg.pretrained is not None:
        check_pretrained_weights(cfg, model_class(cfg), hf_model_config(cfg))


def build_hf_model(cfg: HFConfig, *, seed: int | None = None) -> HFCausalLM:
    """``cfg``'s model in fp32 on the CPU: random weights from the ``transformers`` config class
    (after ``torch.manual_seed(seed)`` when ``seed`` is given; nothing downloaded), or the weights
    of the local directory ``cfg.pretrained`` (``from_pretrained(local_files_only=True)``, safetensors
    only, every weight of the model present and nothing else: ``hf_pretrained``). Under a
    ``torch.device("meta")`` context (shapes only: the runner's memory and plan checks) the model
    is built from the same config without reading any weight (``from_pretrained`` refuses a meta
    context)."""
    conf = hf_model_config(cfg)
    cls = model_class(cfg)
    if seed is not None:
        torch.manual_seed(seed)
    if cfg.pretrained is None or torch.get_default_device().type == "meta":
        hf = cls(conf)
    else:
        check_pretrained_weights(cfg, cls, conf)  # headers only: a refusal costs no tensor read
        hf, info = cls.from_pretrained(
            str(Path(cfg.pretrained).expanduser()),
            config=conf,
            local_files_only=True,
            use_safetensors=True,  # never a pickle
            output_loading_info=True,
        )
        info["unexpected_keys"] = [k for k in info.get("unexpected_keys", ()) if not ignorable(hf, k)]
        left = {k: sorted(v) for k, v in info.items() if v}
        if left:  # what the header check allows, transformers must have loaded whole
            raise ValueError(f"HFConfig.pretrained={cfg.pretrained!r} did not load exactly: {left}")
    hf = hf.float().train()
    if cfg.lora_rank:
        from .lora import apply_lora

        apply_lora(hf, cfg.lora_rank)  # the decoder layers' linear layers; everything else frozen
    return HFCausalLM(hf, cfg)


# ---------------------------------------------------------------------------- tensor parallelism
# Used by zeropp.runtime.tensor_parallel.parallelize (which makes the mesh and localizes the DTensor weights).


def check_hf_tp(cfg: HFConfig, tp: int) -> None:
    """``ValueError`` unless the model has a TP plan (Llama) and ``tp`` divides its heads, key/value
    heads and MLP width (checked before any collective)."""
    if cfg.hf_config != "llama":
        raise ValueError(
            f"topology.tp={tp} has a plan for hf_config=llama only, not {cfg.hf_config!r} (GPT-2's "
            f"fused Conv1D attention is not split); use hf_config=llama or topology.tp=1"
        )
    for what, n in (
        ("attention heads model.n_heads", cfg.n_heads),
        ("key/value heads model.n_kv_heads", cfg.kv_heads),
        ("MLP width model.intermediate_size", cfg.ffn_size),
    ):
        if n % tp:
            raise ValueError(f"topology.tp={tp} must divide the Llama's {what}={n}; choose a tp that divides it")


def parallelize_hf(model: HFCausalLM, tp_mesh: Any) -> None:
    """Split every Llama decoder layer over the 1-D ``tp_mesh`` with torch's TP plans: q/k/v and
    gate/up projections column-parallel, o and down projections row-parallel (heads, kv heads and
    MLP width split; the attention infers its local head count from the projection widths)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

    check_hf_tp(model.cfg, tp_mesh.size())
    plan: dict[str, ParallelStyle] = {f"self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")}
    plan.update(
        {
            "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        }
    )
    for layer in model.blocks:
        parallelize_module(layer, tp_mesh, plan)


__all__ = ["HF_ARCHS", "HFCausalLM", "HFConfig", "build_hf_model", "hf_model_config", "require_transformers"]
