"""The toy model of the wrapping tests: ``x [B, 7] -> pred [B, 5]`` through three residual blocks
whose ``forward`` returns a dict, an output object or a scalar loss, and its deterministic data."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

D_IN, D, D_OUT, N_LAYERS, B = 7, 17, 5, 3, 3
"""Input, hidden and output widths, blocks, and micro-batch size of the toy."""


class ResBlock(nn.Module):
    """A residual block ``h -> {"h": h + tanh(lin(norm(h)))}``, plus any ``borrow``-ed layers."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.lin = nn.Linear(D, D)
        self.borrow: list[nn.Module] = []  # not registered: another block's layer used here (error tests)

    def forward(self, h: torch.Tensor) -> dict[str, torch.Tensor]:  # [B, D] -> {"h": [B, D]}
        y = self.lin(self.norm(h))
        for other in self.borrow:
            y = y + F.linear(h, other.weight)
        return {"h": h + torch.tanh(y)}


@dataclasses.dataclass
class Out:
    """The output-object form: the prediction and, given targets, the loss."""

    pred: torch.Tensor
    loss: torch.Tensor | None = None


class Toy(nn.Module):
    """``x [B, 7] -> pred [B, 5]`` through 3 residual blocks registered as ``l0, l1, l2``."""

    def __init__(self, form: str = "dict", order: tuple[int, ...] = (0, 1, 2)) -> None:
        super().__init__()
        self.form, self.order = form, order
        self.inp = nn.Linear(D_IN, D)
        for i in range(N_LAYERS):
            self.add_module(f"l{i}", ResBlock())
        self.out = nn.Linear(D, D_OUT)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> Any:
        h = self.inp(x)  # [B, D]
        for i in self.order:
            h = getattr(self, f"l{i}")(h)["h"]
        pred = self.out(h)  # [B, 5]
        if self.form == "dict":
            return {"pred": pred}
        loss = None if y is None else F.mse_loss(pred, y)
        return Out(pred, loss) if self.form == "attr" else loss


def mse_of(out: dict[str, torch.Tensor], mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """The loss of the dict form: MSE of ``out["pred"]`` against ``mb["y"]``."""
    return F.mse_loss(out["pred"], mb["y"])


def make_toy(form: str = "dict", **kw: Any) -> Toy:
    """A ``Toy`` of output ``form`` ("dict", "attr" or "scalar") with the same seeded weights every time."""
    torch.manual_seed(0)
    return Toy(form, **kw)


def data(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [B, 7], y [B, 5]) of ``rank``'s micro-batch ``micro`` at ``step``, seeded by all three."""
    g = torch.Generator().manual_seed(7919 * step + 101 * micro + rank)
    x = torch.randn(B, D_IN, generator=g)
    return x, torch.sin(x[:, :D_OUT] * 3) + 0.1 * torch.randn(B, D_OUT, generator=g)
