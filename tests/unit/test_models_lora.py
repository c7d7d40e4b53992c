"""LoRA adapters (``zeropp.models.lora``) against plain torch: the formula, zero-init, what is
frozen, the GPT's ``lora_rank``, Hugging Face-style ``Conv1D`` and the errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zeropp.models import GPT, GPTConfig, LoRALinear, apply_lora, lora_parameters

TINY = GPTConfig(d_model=32, n_layers=2, n_heads=2, seq_len=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1, 1), (7, 17, 3), (17, 257, 8)])
def test_lora_linear_is_the_formula(shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    d_in, d_out, r = shape
    torch.manual_seed(0)
    base = nn.Linear(d_in, d_out).to(dtype)
    x = torch.randn(5, d_in, dtype=dtype)  # [N, in]
    plain = base(x)
    m = LoRALinear(base, r, alpha=3.0)
    assert m.weight is base.weight and m.bias is base.bias  # the base's own Parameters, frozen
    assert not m.weight.requires_grad and not m.bias.requires_grad
    assert m.lora_a.shape == (r, d_in) and m.lora_b.shape == (d_out, r) and m.lora_a.dtype == dtype
    assert torch.equal(m(x), plain)  # B starts at zero: the adapted layer starts as the base
    with torch.no_grad():
        m.lora_b.normal_()
    want = x @ base.weight.t() + base.bias + (3.0 / r) * (x @ m.lora_a.t() @ m.lora_b.t())
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(
        m(x).float(), want.float(), rtol=tol, atol=tol * max(1.0, float(want.detach().abs().max()))
    )


def test_lora_gradients_reach_only_the_adapters() -> None:
    torch.manual_seed(0)
    m = LoRALinear(nn.Linear(7, 17), 2, alpha=4.0)
    with torch.no_grad():
        m.lora_b.normal_()
    m(torch.randn(3, 7)).square().sum().backward()
    assert m.weight.grad is None and m.bias.grad is None
    assert m.lora_a.grad is not None and m.lora_b.grad is not None


def test_transposed_conv1d_layer_like_gpt2() -> None:
    class Conv1D(nn.Module):  # transformers' GPT-2 layer: weight [in, out], y = x @ W + b
        def __init__(self, nf: int, nx: int) -> None:
            super().__init__()
            self.nf = nf
            self.weight = nn.Parameter(torch.randn(nx, nf))
            self.bias = nn.Parameter(torch.randn(nf))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.weight + self.bias

    torch.manual_seed(0)
    model = nn.Sequential(nn.ModuleList([Conv1D(17, 7)]))
    x = torch.randn(4, 7)
    plain = model[0][0](x)
    apply_lora(model, 3)
    layer = model[0][0]
    assert isinstance(layer, LoRALinear) and layer.transposed and (layer.in_features, layer.out_features) == (7, 17)
    torch.testing.assert_close(layer(x), plain)


def test_gpt_lora_rank_freezes_the_base_and_counts_parameters() -> None:
    torch.manual_seed(0)
    base = GPT(TINY)
    torch.manual_seed(0)
    m = GPT(TINY.with_(lora_rank=4))
    trained = {n for n, p in m.named_parameters() if p.requires_grad}
    assert trained == {n for n, _ in lora_parameters(m)}
    assert len(trained) == 2 * 4 * TINY.n_layers  # A and B of qkv, proj, fc, out per block
    assert sum(p.numel() for p in m.parameters()) == m.cfg.num_params()
    assert not m.tok_emb.weight.requires_grad and m.head.weight is m.tok_emb.weight  # head: tied, not adapted
    assert isinstance(m.blocks[0].attn.qkv, LoRALinear) and not isinstance(m.head, LoRALinear)
    # the base weights are those of the plain GPT (same init order), and B = 0: same outputs
    assert set(base.state_dict()) <= set(m.state_dict())
    missing = m.load_state_dict(base.state_dict(), strict=False)
    assert set(missing.missing_keys) == trained and not missing.unexpected_keys
    idx = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(m(idx)[0], base(idx)[0])
    with pytest.raises(ValueError, match="lora_rank must be an integer >= 0"):
        TINY.with_(lora_rank=-1)


def test_apply_lora_targets_and_bad_input() -> None:
    torch.manual_seed(0)
    m = GPT(TINY)
    apply_lora(m, 2, targets=["qkv"])
    assert isinstance(m.blocks[1].attn.qkv, LoRALinear) and not isinstance(m.blocks[1].fc, LoRALinear)
    assert {n for n, p in m.named_parameters() if p.requires_grad} == {
        f"blocks.{i}.attn.qkv.lora_{x}" for i in range(2) for x in "ab"
    }
    no_linear = nn.Sequential(nn.Embedding(10, 4), nn.ModuleList([nn.LayerNorm(4), nn.Conv1d(4, 4, 1)]))
    with pytest.raises(ValueError, match=r"LoRA \(rank 2\) needs linear layers.*no nn.Linear"):
        apply_lora(no_linear, 2)
    with pytest.raises(ValueError, match=r"targets=\['nope'\] matches none"):
        apply_lora(GPT(TINY), 2, targets=["nope"])
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="rank must be an integer >= 1"):
            apply_lora(GPT(TINY), bad)
    with pytest.raises(ValueError, match="alpha must be a number > 0"):
        apply_lora(GPT(TINY), 2, alpha=0)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hf_models_take_lora_rank(arch: str) -> None:
    pytest.importorskip("transformers", reason="the hf extra (pip install -e '.[hf]') is not installed")
    from zeropp.models import HFConfig, build_hf_model

    cfg = HFConfig(hf_config=arch, d_model=32, n_heads=2, n_layers=2, seq_len=16)
    base = build_hf_model(cfg, seed=0)
    m = build_hf_model(cfg.with_(lora_rank=2), seed=0)
    assert sum(p.numel() for p in m.parameters()) == cfg.with_(lora_rank=2).num_params()
    trained = {n for n, p in m.named_parameters() if p.requires_grad}
    assert trained and trained == {n for n, _ in lora_parameters(m)}
    per_layer = 4 if arch == "gpt2" else 7  # c_attn, c_proj, c_fc, mlp.c_proj / q, k, v, o, gate, up, down
    assert len(trained) == 2 * per_layer * cfg.n_layers
    idx = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(m(idx, idx)[1], base(idx, idx)[1])  # B = 0: the base model's loss
    with pytest.raises(ValueError, match="lora_rank must be an integer >= 0"):
        cfg.with_(lora_rank=-2)


def test_a_rank_above_a_layer_or_a_target_matching_nothing_is_refused() -> None:
    """A rank above an adapted layer's min(in, out) adds parameters and no expressiveness, and a
    listed target that matches no layer is a typo: both are refused, naming the layer or target
    (before: a rank of 1000 on a 32-wide model trained adapters larger than their layers, and
    ``targets=["qkv", "prj"]`` adapted ``qkv`` only, silently)."""
    with pytest.raises(
        ValueError, match=r"rank 33 exceeds the smallest adapted layer, blocks.0.attn.qkv \(32 in, 96 out\)"
    ):
        apply_lora(GPT(TINY), 33)
    apply_lora(GPT(TINY), 32)  # full rank is a choice
    with pytest.raises(ValueError, match=r"targets \['prj'\] match none of the linear layers of GPT"):
        apply_lora(GPT(TINY), 2, targets=["qkv", "prj"])
    with pytest.raises(ValueError, match=r"GPTConfig.lora_rank=33 exceeds d_model=32"):
        TINY.with_(lora_rank=33)


def test_hf_lora_rank_above_the_narrowest_layer_is_refused() -> None:
    from zeropp.models import HFConfig

    llama = HFConfig(hf_config="llama", d_model=32, n_heads=4, n_kv_heads=1, n_layers=1)  # k/v: 8 wide
    with pytest.raises(ValueError, match=r"HFConfig.lora_rank=9 exceeds the narrowest adapted layer \(8 wide\)"):
        llama.with_(lora_rank=9)
    llama.with_(lora_rank=8)
    with pytest.raises(ValueError, match=r"lora_rank=33 exceeds the narrowest adapted layer \(32 wide\)"):
        HFConfig(d_model=32, lora_rank=33)
