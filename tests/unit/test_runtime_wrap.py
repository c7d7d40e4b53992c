"""Wrapping any ``nn.Module``: block policies, any micro-batch and output form, and the errors.

Here: the one-process checks. The topic's full description and its gloo-world checks are in
``tests/distributed/test_runtime_wrap.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.wrap_toy import Out, ResBlock, data, make_toy, mse_of
from zeropp.runtime.blocks import find_blocks
from zeropp.runtime.units import build_units


def test_block_policies_choose_the_outermost_matches() -> None:
    m = make_toy()
    assert find_blocks(m) == []  # the default rule: no ModuleList, everything is the root
    assert find_blocks(m, ResBlock) == [m.l0, m.l1, m.l2]
    # a Linear inside a ResBlock belongs to that block; the top-level Linears are blocks of their own
    assert find_blocks(m, [ResBlock, nn.Linear]) == [m.inp, m.l0, m.l1, m.l2, m.out]
    assert find_blocks(m, lambda name, mod: name.startswith("l")) == [m.l0, m.l1, m.l2]
    _units, blocks, root, _ = build_units(m, stage=3, world_size=2, rank=0, dtype=torch.float32, policy=[ResBlock])
    assert [u.name for _, u in blocks] == ["block0", "block1", "block2"]
    assert [s.name for s in root.slots] == ["inp.weight", "inp.bias", "out.weight", "out.bias"]
    # one block object listed twice (weights reused at two depths) is one unit, its second names aliases
    a, b = ResBlock(), ResBlock()
    reuse = nn.Module()
    reuse.blocks = nn.ModuleList([a, b, a])
    _, blocks, root, _ = build_units(reuse, stage=3, world_size=2, rank=0, dtype=torch.float32)
    assert [blk for blk, _ in blocks] == [a, b] and root is None
    assert blocks[0][1].slots[0].name == "blocks.0.norm.weight" and blocks[0][1].slots[0].aliases == (
        "blocks.2.norm.weight",
    )
    # a module registered in two blocks: its parameters go to the root unit
    m2 = make_toy()
    m2.l1.extra = m2.l0.lin
    _, blocks, root, _ = build_units(m2, stage=3, world_size=2, rank=0, dtype=torch.float32, policy=ResBlock)
    assert [s.name for s in root.slots] == [
        "inp.weight",
        "inp.bias",
        "l0.lin.weight",
        "l0.lin.bias",
        "out.weight",
        "out.bias",
    ]
    assert root.slots[2].aliases == ("l1.extra.weight",)
    assert [s.name for s in blocks[0][1].slots] == ["l0.norm.weight", "l0.norm.bias"]
    with pytest.raises(TypeError, match="nn.Module subclasses"):
        find_blocks(m, ["l0"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="callable"):
        find_blocks(m, 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"blocks=\[GRU\] matches no submodule of Toy"):
        find_blocks(m, [nn.GRU])


def test_loss_errors_name_what_was_found() -> None:
    from zeropp.runtime.batch import call_model, loss_of

    m = make_toy("dict")
    x, y = data(0, 0, 0)
    with torch.no_grad():
        out = call_model(m, {"x": x, "y": y})
    with pytest.raises(ValueError, match=r"no loss in the model's output\['loss'\].*loss_fn"):
        loss_of(out, {"x": x})
    with pytest.raises(ValueError, match=r"tensor of shape \[3, 5\], not a one-element"):
        loss_of(out["pred"], x)
    assert float(loss_of(out, {"y": y}, mse_of)) == pytest.approx(float(F.mse_loss(out["pred"], y)))
    assert loss_of(Out(out["pred"], torch.tensor(2.0)), None).item() == 2.0
    assert loss_of((out["pred"], torch.tensor([3.0])), None).shape == ()
