"""LoRA adapters (``zeropp.models.lora``) against plain torch: the formula, zero-init, what is
frozen, the GPT's ``lora_rank``, Hugging Face-style ``Conv1D`` and the errors.

Here: the gloo-world checks of this topic; its other tiers' checks are in ``tests/unit/test_models_lora.py``.
"""

from __future__ import annotations

import torch
from torch import nn

from zeropp.models import LoRALinear, apply_lora


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


