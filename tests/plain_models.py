"""Plain models for the block-choice tests: a Sequential MLP, three Linears held as attributes
(``Plain``, where the default rule finds no blocks), and their deterministic data."""

from __future__ import annotations

import torch
from torch import nn

W, LAYERS, B = 8, 3, 4
"""Width, depth and micro-batch size of the models below."""


def mlp() -> nn.Sequential:
    """``LAYERS`` Linears of width ``W`` with ReLUs between them, seeded."""
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for i in range(LAYERS):
        mods += [nn.Linear(W, W)] + ([nn.ReLU()] if i < LAYERS - 1 else [])
    return nn.Sequential(*mods)


class Plain(nn.Module):
    """Three Linears as attributes: no ModuleList, not a Sequential (the default rule finds nothing)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l0, self.l1, self.l2 = nn.Linear(W, W), nn.Linear(W, W), nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(torch.relu(self.l0(x)))))


def data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of ``rank`` at ``step``, [B, W] each, seeded by both."""
    g = torch.Generator().manual_seed(97 * step + rank)
    return torch.randn(B, W, generator=g), torch.randn(B, W, generator=g)
