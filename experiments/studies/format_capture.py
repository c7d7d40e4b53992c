"""Real tensors for the format study: the weights, gradients and weight differences of a short
training run of the GPT on text, grouped by layer type.

A wire format is judged on the values it will carry, and those differ by kind (weights are near
Gaussian, gradients heavy-tailed, a step's weight differences tiny and sparse-looking) and by layer
(embeddings, attention, MLP, norms and biases). So the study trains the model for a few steps in
this process (plain torch, AdamW; no ranks: the values do not depend on how they are sharded) and
keeps, from the last step, each parameter's value after the step, its gradient and the
difference the step made. Each (kind, layer type) is one flat fp32 vector, in parameter order,
as a ZeRO flat shard would hold it.
"""

from __future__ import annotations

import dataclasses

import torch

from zeropp.models.gpt import GPT, GPTConfig

from ..runner.data import TokenBatches
from ..runner.sections import DataConfig

KINDS = ("weights", "grads", "weight_diffs")
"""What a ZeRO++ collective carries: qwZ gathers weights, qgZ reduces gradients, qWD sends the
difference a step made to the weights."""

LAYER_TYPES = ("embedding", "attention", "mlp", "norm", "bias")
"""How parameters are grouped: token and position embeddings (the head is tied to the token
embedding), the attention's qkv and output projections, the MLP's two linears, the LayerNorm gains
and shifts, and the linears' biases."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CaptureConfig:
    """The short training run whose last step is captured."""

    model: str = "small"
    """GPT preset (``zeropp.models.gpt``: tiny, small, medium, large)."""
    steps: int = 20
    """Optimizer steps before the captured one (the values of step 0 are the initialization's)."""
    batch: int = 8
    """Sequences per step."""
    lr: float = 1e-3
    """AdamW learning rate."""
    seed: int = 0
    """Seeds the model's initialization and the batches."""

    def __post_init__(self) -> None:
        GPTConfig.preset(self.model)  # a clear ValueError for an unknown preset
        for name in ("steps", "batch"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"CaptureConfig.{name} must be an int >= 1, got {v!r}")
        if not self.lr > 0:
            raise ValueError(f"CaptureConfig.lr must be > 0, got {self.lr!r}")


def layer_type(name: str) -> str:
    """The layer type (:data:`LAYER_TYPES`) of the GPT parameter called ``name``."""
    parts = name.split(".")
    if parts[-1] == "bias":
        return "bias"
    if parts[0] in ("tok_emb", "pos_emb", "head"):
        return "embedding"
    if "attn" in parts:
        return "attention"
    if len(parts) >= 2 and parts[-2] in ("fc", "out"):
        return "mlp"
    if len(parts) >= 2 and parts[-2].startswith("ln"):
        return "norm"
    raise ValueError(f"no layer type for GPT parameter {name!r}; add it to format_capture.layer_type")


def capture(cfg: CaptureConfig) -> dict[str, dict[str, torch.Tensor]]:
    """Train ``cfg.steps`` steps, then capture one more: ``{kind: {layer type: flat fp32 [n]}}``."""
    torch.manual_seed(cfg.seed)
    gpt_cfg = GPTConfig.preset(cfg.model)
    model = GPT(gpt_cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    batches = TokenBatches(
        DataConfig(max_bytes=1_000_000),
        seq_len=gpt_cfg.seq_len,
        batch=cfg.batch,
        vocab_size=gpt_cfg.vocab_size,
        seed=cfg.seed,
        rank=0,
        device=torch.device("cpu"),
    )
    named = list(model.named_parameters())
    for step in range(cfg.steps + 1):
        idx, targets = batches.next()
        _, loss = model(idx, targets)
        assert loss is not None
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if step == cfg.steps:
            before = [p.detach().clone() for _, p in named]
            grads = [p.grad.detach().clone() for _, p in named]  # type: ignore[union-attr]
        opt.step()
    parts: dict[str, dict[str, list[torch.Tensor]]] = {k: {t: [] for t in LAYER_TYPES} for k in KINDS}
    for (name, p), b, g in zip(named, before, grads):
        t = layer_type(name)
        parts["weights"][t].append(p.detach().reshape(-1))
        parts["grads"][t].append(g.reshape(-1))
        parts["weight_diffs"][t].append((p.detach() - b).reshape(-1))
    return {k: {t: torch.cat(v).float() for t, v in by.items() if v} for k, by in parts.items()}
