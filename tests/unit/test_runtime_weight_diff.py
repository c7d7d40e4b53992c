"""qWD (``ZeroConfig.weight_diff``, ``zeropp/runtime/weight_diff.py``).

Here: the one-process checks. The topic's full description and its gloo-world checks are in
``tests/distributed/test_runtime_weight_diff.py``.
"""

from __future__ import annotations

import pytest

from tests.experiment_helpers import composed_config
from zeropp.comm.spec import RECIPES, QuantRecipe, QuantSpec
from zeropp.runtime import ZeroConfig

W8, W4 = QuantSpec(bits=8), QuantSpec(bits=4)


# ---------------------------------------------------------------------- configuration (no world)
@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(stage=0, weight_diff=W4), ["weight_diff", "stage 0", "stage>=1"]),
        (dict(stage=3, weight_diff=W4), ["weight_diff", "hpz=False", "hpz=True"]),
        (dict(stage=2, weight_diff=W4.replace(error_feedback=True)), ["weight_diff", "error_feedback=True"]),
        (dict(stage=2, weight_diff=QuantSpec(bits=4, intra_bits=8)), ["weight_diff", "intra_bits=8"]),
        (dict(stage=2, weight_diff={"bits": 4}), ["weight_diff", "QuantSpec"]),
    ],
)
def test_bad_settings_are_refused(kw, words):
    with pytest.raises(ValueError) as e:
        ZeroConfig(**kw)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_recipes():
    sdp = RECIPES["sdp4bit"]
    assert sdp.weights == W4 and sdp.hpz and sdp.weight_diff == W4
    assert sdp.grads == QuantSpec(bits=4, rotation="hadamard", error_feedback=True)
    cfg = ZeroConfig.from_recipe("sdp4bit", stage=3)
    assert (cfg.weights, cfg.grads, cfg.weight_diff, cfg.hpz) == (sdp.weights, sdp.grads, sdp.weight_diff, True)
    qwd = ZeroConfig.from_recipe("qwd")  # every recipe is valid at the default stage 3
    assert (qwd.weights, qwd.grads, qwd.weight_diff, qwd.hpz) == (None, None, W4, True)
    with pytest.raises(ValueError, match="weight_diff"):
        ZeroConfig.from_recipe("sdp4bit", weight_diff=W8)
    assert ZeroConfig.from_recipe(QuantRecipe(weight_diff=W8), stage=1).weight_diff == W8


def test_runner_recipes_carry_weight_diff():
    """``quant=sdp4bit`` / ``quant=qwd`` reach ZeroConfig with their weight_diff, refinable as
    ``zero.weight_diff.bits=8``; stages 1-2 through ``quant=qwd zero.hpz=false``."""
    from zeropp.experiments.runner.config import from_dict

    for name in ("sdp4bit", "qwd", "zeropp"):
        rc = from_dict(composed_config(f"quant={name}"))
        r = RECIPES[name]
        assert (rc.zero.weights, rc.zero.grads, rc.zero.weight_diff, rc.zero.hpz) == (
            r.weights,
            r.grads,
            r.weight_diff,
            r.hpz,
        )
    rc = from_dict(composed_config("quant=sdp4bit", "zero.weight_diff.bits=8"))
    assert rc.zero.weight_diff == W8 and "qWD[int8]" in rc.describe()
    rc = from_dict(composed_config("quant=qwd", "stage=2", "zero.hpz=false"))
    assert rc.zero.stage == 2 and rc.zero.weight_diff == W4 and not rc.zero.hpz
