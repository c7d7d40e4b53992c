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

The pieces by role: ``hf_config.py`` (:class:`HFConfig`, the settings), ``hf_transformers.py``
(the ``transformers`` config object they give, and the record a checkpoint keeps of it),
``hf_pretrained.py`` (a ``save_pretrained`` directory's files, checked by their headers), here the
model (build, wrap, tensor-parallel plan), which also names the others' public pieces;
``hf_export.py`` and ``hf_tokenizer.py`` write a run's checkpoint back out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .hf_config import HF_ARCHS, INSTALL_HINT, HFConfig, size_mismatch
from .hf_pretrained import check_pretrained_weights, ignorable
from .hf_transformers import config_differences, hf_model_config, recorded_config, require_transformers


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


__all__ = [  # the settings and the transformers config re-exported: zeropp.models.hf names every HF piece
    "HF_ARCHS",
    "INSTALL_HINT",
    "HFCausalLM",
    "HFConfig",
    "build_hf_model",
    "check_hf_tp",
    "check_pretrained",
    "config_differences",
    "hf_model_config",
    "model_class",
    "parallelize_hf",
    "recorded_config",
    "require_transformers",
    "size_mismatch",
]
