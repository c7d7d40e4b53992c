"""LoRA adapters: a frozen base model plus small trainable low-rank updates.

LoRA (Hu et al., 2021) replaces ``y = x W^T + b`` by ``y = x W^T + b + (alpha / r) * x A^T B^T``
with ``A: [r, in]`` and ``B: [out, r]`` trained and ``W``, ``b`` frozen. ``B`` starts at zero, so the
adapted model starts as the base model. Here it is the example workload of MixZ++: the large frozen
base is what ZeRO-3 shards (and, with ``ZeroConfig.quantize_frozen``, stores quantized), the
adapters are the few trained parameters.

:class:`LoRALinear` *is* an ``nn.Linear`` (its ``weight`` and ``bias`` are the wrapped layer's own
``Parameter`` objects, under the same names), so a base checkpoint still loads into the adapted
model (with ``strict=False`` for the new ``lora_a`` / ``lora_b`` keys) and code that inspects
``nn.Linear`` modules keeps working. :func:`apply_lora` swaps the targeted layers in place and
freezes everything else, embeddings included; it works on any ``nn.Module`` (the built-in GPT,
Hugging Face models), and also on ``transformers``' ``Conv1D`` (GPT-2's projections, whose weight
is stored transposed).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

Targets = Union[None, Sequence[str], Callable[[str, nn.Module], bool]]
"""Which linear layers get adapters: None (every linear layer inside a ``ModuleList``, i.e. the
repeated blocks' projections, not an output head), a list of name suffixes (``["qkv", "proj"]``
matches ``blocks.0.attn.qkv``), or ``callable(qualified_name, module) -> bool``."""


class LoRALinear(nn.Linear):
    """``nn.Linear`` with a frozen base and a trainable rank-``rank`` update scaled by ``alpha / rank``.

    ``transposed=True`` serves ``transformers``' ``Conv1D``, whose weight is ``[in, out]``.
    """

    def __init__(self, base: nn.Module, rank: int, alpha: float, *, transposed: bool = False) -> None:
        nn.Module.__init__(self)  # not nn.Linear.__init__: the base's parameters are reused, not re-created
        w, bias = base.weight, base.bias
        assert isinstance(w, nn.Parameter) and (bias is None or isinstance(bias, nn.Parameter)), "a Linear or Conv1D"
        self.transposed = transposed
        self.in_features, self.out_features = (w.shape[0], w.shape[1]) if transposed else (w.shape[1], w.shape[0])
        self.weight = w  # [out, in] ([in, out] if transposed), frozen
        self.bias = bias  # [out] or None, frozen
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.rank, self.alpha = rank, float(alpha)
        self.scaling = self.alpha / rank
        dev, dt = w.device, w.dtype
        self.lora_a = nn.Parameter(torch.empty(rank, self.in_features, device=dev, dtype=dt))  # [r, in]
        self.lora_b = nn.Parameter(torch.zeros(self.out_features, rank, device=dev, dtype=dt))  # [out, r], zero-init
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))  # as nn.Linear's weight init

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        w = self.weight.t() if self.transposed else self.weight  # [out, in]
        y = F.linear(x, w, self.bias)
        return y + F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scaling

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, "
            f"alpha={self.alpha}, bias={self.bias is not None}"
        )


def _is_conv1d(m: nn.Module) -> bool:
    """``transformers.pytorch_utils.Conv1D`` (GPT-2), recognised without importing transformers."""
    return type(m).__name__ == "Conv1D" and hasattr(m, "nf") and isinstance(getattr(m, "weight", None), torch.Tensor)


def _in_out(m: nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of an ``nn.Linear`` or a ``Conv1D`` (weight ``[in, out]``)."""
    w = m.weight
    assert isinstance(w, torch.Tensor)
    return (w.shape[0], w.shape[1]) if _is_conv1d(m) else (w.shape[1], w.shape[0])


def _matcher(model: nn.Module, targets: Targets) -> Callable[[str, nn.Module], bool]:
    if targets is None:
        lists = [n for n, m in model.named_modules() if isinstance(m, nn.ModuleList)]
        return lambda name, m: any(name.startswith(p + ".") for p in lists) if lists else False
    if callable(targets):
        return targets
    if isinstance(targets, str):
        targets = [targets]
    suffixes = tuple(targets)
    return lambda name, m: any(name == s or name.endswith("." + s) for s in suffixes)


def apply_lora(model: nn.Module, rank: int, *, alpha: float | None = None, targets: Targets = None) -> nn.Module:
    """Give the targeted linear layers of ``model`` LoRA adapters and freeze every other parameter.

    ``rank`` (>= 1) is ``r``; ``alpha`` defaults to ``2 * rank`` (scaling 2). Modifies ``model`` in
    place and returns it. A model (or a ``targets`` choice) without any ``nn.Linear`` / ``Conv1D``
    layer to adapt, a listed target that matches no layer, and a rank above an adapted layer's
    ``min(in, out)`` are ``ValueError``: they depend only on the model, so every rank raises them
    alike, before any training.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"apply_lora: rank must be an integer >= 1, got {rank!r}")
    alpha = 2.0 * rank if alpha is None else alpha
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise ValueError(f"apply_lora: alpha must be a number > 0, got {alpha!r}")
    match = _matcher(model, targets)
    chosen = [
        (n, m)
        for n, m in model.named_modules()
        if n and not isinstance(m, LoRALinear) and (isinstance(m, nn.Linear) or _is_conv1d(m)) and match(n, m)
    ]
    if not chosen:
        linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) or _is_conv1d(m)]
        what = (
            "it has no nn.Linear (or Conv1D) layer at all"
            if not linear
            else f"targets={targets!r} matches none of its linear layers {linear[:8]}"
        )
        raise ValueError(
            f"LoRA (rank {rank}) needs linear layers to adapt, but {type(model).__name__}: {what}; "
            f"use lora_rank=0 for this model, or pass targets naming its linear layers"
        )
    if targets is not None and not callable(targets):  # a listed suffix that names nothing is a typo, not a choice
        names = [targets] if isinstance(targets, str) else list(targets)
        unused = [t for t in names if not any(n == t or n.endswith("." + t) for n, _ in chosen)]
        if unused:
            raise ValueError(
                f"apply_lora: targets {unused} match none of the linear layers of {type(model).__name__} "
                f"(the others match {[n for n, _ in chosen][:4]}); remove them or name existing layers"
            )
    widths = {n: _in_out(m) for n, m in chosen}
    small = min(widths, key=lambda n: min(widths[n]))
    if rank > min(widths[small]):
        raise ValueError(
            f"apply_lora: rank {rank} exceeds the smallest adapted layer, {small} ({widths[small][0]} in, "
            f"{widths[small][1]} out): its update B @ A has rank at most {min(widths[small])}, so a larger "
            f"rank only adds parameters; choose a rank <= {min(widths[small])}"
        )
    for p in model.parameters():
        p.requires_grad_(False)
    adapted = {id(m): LoRALinear(m, rank, alpha, transposed=_is_conv1d(m)) for _, m in chosen}
    # every registration of a chosen module (one registered twice gets the same adapter twice)
    for name, m in list(model.named_modules(remove_duplicate=False)):
        if name and id(m) in adapted:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, adapted[id(m)])
    return model


def lora_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The adapters' ``(name, parameter)`` pairs (what LoRA trains)."""
    return [(n, p) for n, p in model.named_parameters() if n.endswith(("lora_a", "lora_b"))]
