"""A small GPT-style decoder for experiments and tests.

Byte-level vocabulary (256 symbols), so any text trains without a tokenizer download. The
transformer blocks live in ``model.blocks`` (a ``ModuleList``): the ZeRO-3 runtime gathers and
frees parameters per block, so a block is the natural unit of communication. Everything else
(embeddings, final norm, head) is the "root" and is small. There is no dropout and no buffer, so
two runs with the same weights and data are bit-for-bit reproducible, which the exactness tests
rely on. As in GPT-2, the output head shares its weight with the token embedding
(``GPTConfig.tie_embeddings``, on by default): one ``Parameter`` registered as both
``tok_emb.weight`` and ``head.weight``, so autograd sums both uses into one gradient and the
ZeRO runtime keeps one shard of it (``zeropp.runtime.partition``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

BYTE_VOCAB = 256

_PRESETS: dict[str, dict[str, int]] = {
    # name: width, depth, heads, context; parameter counts are for vocab 256 with tied embeddings.
    "tiny": dict(d_model=32, n_layers=2, n_heads=2, seq_len=16),  # ~35k params, unit tests
    "mini": dict(d_model=64, n_layers=2, n_heads=2, seq_len=64),  # ~0.12M params, the runner's default job
    "small": dict(d_model=128, n_layers=4, n_heads=4, seq_len=64),  # ~0.83M params, CPU sweeps
    "medium": dict(d_model=256, n_layers=4, n_heads=4, seq_len=128),  # ~3.3M params, like background.md
    "large": dict(d_model=512, n_layers=8, n_heads=8, seq_len=256),  # ~25M params, GPU runs
}
PRESETS = _PRESETS
"""The named sizes of :meth:`GPTConfig.preset` (read it, do not change it); the runner's ``model=``
options are generated from it."""


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of the model. Frozen so it can be hashed, logged and compared."""

    vocab_size: int = BYTE_VOCAB
    """Number of token ids; 256 for raw bytes."""
    seq_len: int = 64
    """Longest sequence the position embedding covers."""
    d_model: int = 128
    """Residual stream width."""
    n_layers: int = 4
    """Number of transformer blocks (the ZeRO-3 gather units)."""
    n_heads: int = 4
    """Attention heads; must divide ``d_model``."""
    mlp_ratio: int = 4
    """Hidden width of the MLP as a multiple of ``d_model``."""
    tie_embeddings: bool = True
    """Share the output head's weight with the token embedding (GPT-2 does): one ``[vocab, d_model]``
    parameter under two names, ``tok_emb.weight`` and ``head.weight``. False gives the head its own."""
    lora_rank: int = 0
    """LoRA fine-tuning (``zeropp.models.lora``): > 0 gives every linear layer of the blocks (``qkv``,
    ``proj``, ``fc``, ``out``) a trainable rank-``lora_rank`` adapter (alpha = 2 * rank) and freezes
    the rest of the model, embeddings and head included; 0 (default) trains everything."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise ValueError(f"GPTConfig.lora_rank must be an integer >= 0 (0: no LoRA), got {self.lora_rank!r}")
        if self.lora_rank > self.d_model:  # every adapted layer has d_model inputs or outputs
            raise ValueError(
                f"GPTConfig.lora_rank={self.lora_rank} exceeds d_model={self.d_model}: an adapter's update has "
                f"rank at most {self.d_model}, so a larger rank only adds parameters; choose lora_rank <= {self.d_model}"
            )
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"GPTConfig.tie_embeddings must be true or false, got {self.tie_embeddings!r}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"GPTConfig: n_heads={self.n_heads} must divide d_model={self.d_model}; "
                f"pick d_model as a multiple of n_heads"
            )

    @classmethod
    def preset(cls, name: str, **overrides: int | bool) -> GPTConfig:
        """A named size (``tiny``, ``small``, ``medium``, ``large``) with optional overrides."""
        if name not in _PRESETS:
            raise ValueError(f"unknown GPT preset {name!r}; choose one of {sorted(_PRESETS)}")
        return cls(**{**_PRESETS[name], **overrides})  # type: ignore[arg-type]  # mypy types ** of a dict by its value union

    def with_(self, **changes: int | bool) -> GPTConfig:
        return replace(self, **changes)  # type: ignore[arg-type]  # mypy types ** of a dict by its value union

    def num_params(self) -> int:
        """Exact parameter count, a tied weight counted once (matches ``sum(p.numel() for p in
        GPT(cfg).parameters())``, which yields a shared parameter once), LoRA adapters included."""
        d, h = self.d_model, self.d_model * self.mlp_ratio
        block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * h + h) + (h * d + d)
        block += self.lora_rank * ((d + 3 * d) + (d + d) + (d + h) + (h + d))  # A [r, in] + B [out, r] per linear
        head = self.vocab_size if self.tie_embeddings else d * self.vocab_size + self.vocab_size  # bias (+ weight)
        return self.vocab_size * d + self.seq_len * d + self.n_layers * block + 2 * d + head


class CausalSelfAttention(nn.Module):
    tp: int
    """Tensor-parallel degree, set by :func:`parallelize_gpt` (read by its forward)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape  # [B, T, D]
        q, k, v = self.qkv(x).split(d, dim=2)  # each [B, T, D]
        shape = (b, t, self.n_heads, d // self.n_heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))  # [B, H, T, D/H]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, D/H]
        return self.proj(y.transpose(1, 2).reshape(b, t, d))  # [B, T, D]


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.out = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, D] -> [B, T, D]
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """``model(idx, targets=None) -> (logits [B, T, V], loss or None)``; loss is mean cross-entropy."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight  # [V, D] both: one Parameter, two names
        self._init_weights()
        if cfg.lora_rank:
            from .lora import apply_lora

            apply_lora(self, cfg.lora_rank, targets=lambda name, m: name.startswith("blocks."))

    def _init_weights(self) -> None:
        # GPT-2 style: N(0, 0.02), residual projections scaled down by depth so deep stacks start stable.
        # named_parameters() yields a tied weight once, under its first name (tok_emb.weight).
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * self.cfg.n_layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        _b, t = idx.shape  # [B, T] int64 byte ids
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence length {t} exceeds GPTConfig.seq_len={self.cfg.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)  # [B, T, D]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))  # [B, T, V]
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def byte_batch(
    data: bytes | torch.Tensor, batch: int, seq_len: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of a byte string: ``(idx [B, T], targets [B, T])`` with targets shifted by one."""
    buf = data if isinstance(data, torch.Tensor) else torch.frombuffer(bytearray(data), dtype=torch.uint8)
    if buf.numel() < seq_len + 2:
        raise ValueError(f"need at least {seq_len + 2} bytes of data, got {buf.numel()}")
    starts = torch.randint(0, buf.numel() - seq_len - 1, (batch,), generator=generator)
    win = torch.stack([buf[s : s + seq_len + 1] for s in starts.tolist()]).long()  # [B, T+1]
    return win[:, :-1].contiguous(), win[:, 1:].contiguous()


# ---------------------------------------------------------------------------- tensor parallelism
# Used by zeropp.runtime.tensor_parallel.parallelize (which makes the mesh and localizes the
# DTensor weights); kept apart from the model so the plain GPT stays torch-only.


def check_gpt_tp(cfg: GPTConfig, tp: int) -> None:
    """``ValueError`` unless ``tp`` divides the GPT's heads and MLP width (checked before any collective)."""
    if cfg.n_heads % tp:
        raise ValueError(
            f"topology.tp={tp} must divide the GPT's attention heads model.n_heads={cfg.n_heads}; "
            f"choose a tp that divides {cfg.n_heads} or more heads"
        )
    if (cfg.mlp_ratio * cfg.d_model) % tp:
        raise ValueError(
            f"topology.tp={tp} must divide the GPT's MLP width mlp_ratio*d_model={cfg.mlp_ratio * cfg.d_model}"
        )


def _tp_attention_forward(self: CausalSelfAttention, x: torch.Tensor) -> torch.Tensor:
    """Attention on this rank's heads: ``qkv`` is column-parallel (rows reordered so the local
    output is ``[q_t | k_t | v_t]``), ``proj`` row-parallel (its plan sums over tp)."""
    b, t, _ = x.shape  # [B, T, D] replicated over tp
    qkv = self.qkv(x)  # [B, T, 3 * D/tp] local
    dl = qkv.shape[-1] // 3
    heads = self.n_heads // self.tp
    q, k, v = qkv.split(dl, dim=2)  # each [B, T, D/tp]
    shape = (b, t, heads, dl // heads)
    q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))  # [B, H/tp, T, D/H]
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H/tp, T, D/H]
    return self.proj(y.transpose(1, 2).reshape(b, t, dl))  # [B, T, D]


@torch.no_grad()
def parallelize_gpt(model: GPT, tp_mesh) -> None:
    """Split every block over the 1-D ``tp_mesh`` with torch's TP plans: ``qkv`` and ``fc``
    column-parallel, ``proj`` and ``out`` row-parallel (heads and MLP width split; embeddings,
    norms and head replicated). ``qkv``'s rows are first reordered from ``[q | k | v]`` to
    ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]`` so that rank t's row shard holds its heads of all three
    (recorded as ``zeropp_tp_interleave`` so full weights can be put back in order)."""
    import types

    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = tp_mesh.size()
    check_gpt_tp(model.cfg, tp)
    plan = {
        "attn.qkv": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
        "fc": ColwiseParallel(),
        "out": RowwiseParallel(),
    }
    for block in model.blocks:
        assert isinstance(block, Block)
        attn = block.attn
        for name in ("weight", "bias"):
            p = getattr(attn.qkv, name)
            p.copy_(p.reshape(3, tp, -1, *p.shape[1:]).transpose(0, 1).reshape(p.shape))  # [3D(, D)] reordered
        # a plain attribute: torch's stub types Module.__setattr__ for tensors and modules only
        attn.qkv.zeropp_tp_interleave = {"weight": 3, "bias": 3}  # type: ignore[assignment]
        attn.tp = tp
        attn.forward = types.MethodType(_tp_attention_forward, attn)  # type: ignore[method-assign]  # this instance's TP forward
        parallelize_module(block, tp_mesh, plan)
