"""The engine with ``quant=w4g4h`` (INT4 weights, INT4 Hadamard-rotated gradients on both qgZ
hops): stage 3 on a 2-node x 2-rank gloo world, tiny GPT on English text, against the
unquantized run and ``w4g4``. A third run rotates the weight gathers as well (``qwZ`` through the
rotated codec, bucketed into row-strided outputs): it must train within ``TOL_ROTATED_WEIGHTS``.

Property (tolerant, stated here): over ``STEPS`` steps, where the loss falls by more than 0.5,
every step's loss stays within ``TOL_4BIT`` (relative) of the unquantized run's, and the mean
absolute gap to it is no larger than ``w4g4``'s plus ``SLACK`` (relative to the mean loss): the
rotation must not make 4-bit communication track full precision worse. Rotated and unrotated
runs move the same bytes.
"""

import pytest

from tests.runtime_helpers import train_engine
from tests.worlds import run_world
from zeropp.comm.spec import RECIPES

STEPS, LR = 8, 1e-2
TOL_4BIT = 0.03
SLACK = 0.002
TOL_ROTATED_WEIGHTS = 0.05
"""Rotating the 4-bit weight gathers too moves the loss further from fp (measured: up to 2.9%
per step, in both directions), as the recipe's docstring explains; a looser bound for that run."""


def _recipe(name: str) -> dict:
    if name == "w4h_g4h":
        r = RECIPES["w4g4h"]
        return dict(stage=3, weights=r.weights.replace(rotation="hadamard"), grads=r.grads)
    r = RECIPES[name]
    return dict(stage=3, weights=r.weights, grads=r.grads, hpz=r.hpz)


def _world(rank, world):
    return {
        name: train_engine(rank, world, _recipe(name), steps=STEPS, nodes=2, lr=LR, text=True, consolidate=False)
        for name in ("none", "w4g4", "w4g4h", "w4h_g4h")
    }


@pytest.fixture(scope="module")
def runs():
    return run_world(_world, 4, timeout=300)[0]


def _mean_gap(losses: list[float], base: list[float]) -> float:
    return sum(abs(a - b) for a, b in zip(losses, base)) / len(base)


def test_w4g4h_tracks_the_fp_loss_at_least_as_well_as_w4g4(runs):
    base = runs["none"]["losses"]
    assert base[0] - min(base) > 0.5, f"training must make progress for the comparison to mean something: {base}"
    rot, plain = runs["w4g4h"]["losses"], runs["w4g4"]["losses"]
    assert rot != plain, "the rotation must change what is sent"
    for step, (a, b) in enumerate(zip(rot, base)):
        assert abs(a - b) <= TOL_4BIT * b, (step, rot, base)
    mean_loss = sum(base) / len(base)
    assert _mean_gap(rot, base) <= _mean_gap(plain, base) + SLACK * mean_loss, (rot, plain, base)


def test_rotated_weight_gathers_train_within_tolerance(runs):
    base, rot = runs["none"]["losses"], runs["w4h_g4h"]["losses"]
    assert rot != runs["w4g4h"]["losses"]
    for step, (a, b) in enumerate(zip(rot, base)):
        assert abs(a - b) <= TOL_ROTATED_WEIGHTS * b, (step, rot, base)


def test_rotation_moves_the_bytes_of_w4g4(runs):
    assert runs["w4g4h"]["comm"] == runs["w4g4"]["comm"] == runs["w4h_g4h"]["comm"]
