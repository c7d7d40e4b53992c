"""A plain ``nn.Sequential`` MLP through ``ZeroEngine``, as a user writes it first: no surprises.

Here: the one-process checks. The topic's full description and its gloo-world checks are in
``tests/distributed/test_runtime_plain_module.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.plain_models import Plain, W, data, mlp
from zeropp.runtime import MicroBatchError, WithTargets
from zeropp.runtime.batch import call_model, per_rank
from zeropp.runtime.blocks import find_blocks, one_unit_warning
from zeropp.runtime.units import build_units

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Plain()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def _units(model: nn.Module, policy: Any = None, stage: int = 3) -> list:
    units, _, _, _ = build_units(model, stage=stage, world_size=2, rank=0, dtype=torch.float32, policy=policy)
    return units


def test_sequential_children_with_parameters_are_the_default_blocks() -> None:
    m = mlp()
    assert find_blocks(m) == [m[0], m[2], m[4]]  # the Linears; a ReLU has nothing to gather
    assert [u.name for u in _units(m)] == ["block0", "block1", "block2"]
    # the earlier rules still come first: a ModuleList inside a Sequential is the block list
    seq = nn.Sequential(nn.Linear(W, W), nn.ModuleList([nn.Linear(W, W), nn.Linear(W, W)]))
    assert find_blocks(seq) == list(seq[1])
    assert find_blocks(Plain()) == []  # a plain module: no blocks (the warning below says so)


def test_one_unit_warning_names_blocks_and_only_fires_for_one_gathered_unit() -> None:
    msg = one_unit_warning(Plain(), None, _units(Plain()))
    assert msg is not None and "found no blocks in Plain" in msg and "blocks=" in msg, msg
    assert "one unit ('root') holds all 216 trainable parameters" in msg, msg
    # a policy that leaves one unit holding everything warns too, naming the policy
    msg = one_unit_warning(Wrapper(), Plain, _units(Wrapper(), Plain))
    assert msg is not None and "blocks=Plain leaves one unit in Wrapper" in msg and "'block0'" in msg, msg
    # several gathered units, or no stage-3 gathering at all: nothing to say
    assert one_unit_warning(Plain(), nn.Linear, _units(Plain(), nn.Linear)) is None
    assert one_unit_warning(mlp(), None, _units(mlp())) is None
    assert one_unit_warning(Plain(), None, _units(Plain(), stage=2)) is None


def test_a_batch_the_forward_cannot_take_says_what_was_called_and_how_to_pass_targets() -> None:
    m = mlp()
    x, y = data(0, 0)
    with pytest.raises(MicroBatchError) as e:
        call_model(m, (x, y))
    msg = str(e.value)
    assert "called the model as Sequential(<float32 [4, 8]>, <float32 [4, 8]>)" in msg, msg
    assert "tuple micro-batch is unpacked into positional arguments" in msg and "Sequential.forward(input)" in msg
    assert "WithTargets(inputs, targets)" in msg and "loss_fn=" in msg and "mb.targets" in msg, msg
    assert isinstance(e.value.__cause__, TypeError)  # the forward's own error is kept as the cause
    with pytest.raises(
        MicroBatchError,
        match=r"Sequential\(input=<float32 \[4, 8\]>, target=<float32 \[4, 8\]>\) "
        r"\(a dict micro-batch is passed as keyword arguments",
    ):
        call_model(m, {"input": x, "target": y})
    with pytest.raises(MicroBatchError, match=r"WithTargets.inputs: a tuple micro-batch"):
        call_model(m, WithTargets((x, y), y))
    # WithTargets: the model sees the inputs only, the result is the plain call's
    with torch.no_grad():
        assert torch.equal(call_model(m, WithTargets(x, y)), m(x))

    class Broken(nn.Module):  # takes its argument, then raises TypeError inside: the model's own error
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + "oops"  # type: ignore[operator]

    with pytest.raises(TypeError) as e2:
        call_model(Broken(), x)
    assert not isinstance(e2.value, MicroBatchError)


def test_identical_rank_errors_read_once() -> None:
    assert per_rank({0: "A", 1: "A", 3: "B"}) == "ranks 0, 1: A; rank 3: B"


def test_torch_adam_allocates_its_moments_at_the_first_step() -> None:
    m = mlp()
    opt = torch.optim.Adam(m.parameters())
    assert len(opt.state) == 0  # after creation: no state at all
    F.mse_loss(m(data(0, 0)[0]), data(0, 0)[1]).backward()
    opt.step()
    psi = sum(p.numel() for p in m.parameters())
    moments = sum(s[k].numel() * s[k].element_size() for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq"))
    assert moments == 8 * psi
