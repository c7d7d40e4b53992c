"""zeropp.runtime.divergence: the rule that stops a diverged run (unit level, no process group).

The end-to-end behaviour (every rank stops, exit status, summary, no checkpoint of the diverged
step) is in ``tests/{unit,e2e}/test_experiments_diverge.py``.
"""

from __future__ import annotations

import json
import math

import pytest

from zeropp.runtime.divergence import EXIT_CODE, DivergenceError, DivergenceGuard

NAN, INF = float("nan"), float("inf")


def _good_steps(guard: DivergenceGuard, steps: range) -> None:
    for s in steps:
        assert guard.check(s, 5.0 - 0.1 * s, 1.5, False, loss_scale=1.0) is None


def test_fp32_nan_loss_stops_at_that_step():
    g = DivergenceGuard(loss_scaling=False, advice="lower optim.lr")
    _good_steps(g, range(1, 4))
    with pytest.raises(DivergenceError) as ei:
        g.check(4, NAN, NAN, True)
    e = ei.value
    assert (e.step, e.reason, e.exit_code) == (4, "non_finite", EXIT_CODE)
    assert math.isnan(e.loss) and math.isnan(e.grad_norm)
    assert str(e) == (
        "training diverged at step 4: loss=nan, gradient norm=nan (the loss is not finite). To fix: lower optim.lr."
    )


def test_fp32_inf_norm_with_a_finite_loss_stops():
    g = DivergenceGuard(loss_scaling=False)
    _good_steps(g, range(1, 3))
    with pytest.raises(
        DivergenceError,
        match=r"step 3: loss=4\.2, gradient norm=inf \(the gradient norm is not "
        r"finite\)\. To fix: lower the learning rate \(optim\.lr\)",
    ):
        g.check(3, 4.2, INF, False)


def test_a_trainer_without_a_norm_is_judged_by_its_loss():
    g = DivergenceGuard(loss_scaling=False)
    assert g.check(1, 3.0, None, False) is None
    with pytest.raises(DivergenceError, match="gradient norm=n/a"):
        g.check(2, INF, None, False)


def test_fp16_streak_below_the_limit_then_a_good_step_resets_it():
    g = DivergenceGuard(loss_scaling=True, max_skipped_steps=5)
    for s in range(1, 5):  # 4 = N - 1 overflows in a row: normal loss-scale search
        g.check(s, 5.0, NAN, True, loss_scale=2.0 ** (20 - s))
    assert g.streak == 4
    assert g.check(5, 5.0, 2.0, False, loss_scale=2.0**15) is None  # a finite step ends the streak
    assert g.streak == 0
    for s in range(6, 10):  # another 4: still fine, the count restarted
        g.check(s, 5.0, INF, True, loss_scale=1.0)
    assert (g.streak, g.skipped_steps) == (4, 8)


def test_fp16_streak_of_n_stops():
    g = DivergenceGuard(
        loss_scaling=True,
        max_skipped_steps=3,
        max_skipped_name="train.max_skipped_steps",
        advice="lower zero.loss_scale_init",
    )
    _good_steps(g, range(1, 3))
    g.check(3, 5.0, NAN, True, loss_scale=4.0)
    g.check(4, 5.0, NAN, True, loss_scale=2.0)
    with pytest.raises(DivergenceError) as ei:
        g.check(5, 5.0, NAN, True, loss_scale=1.0)
    e = ei.value
    assert (e.step, e.reason, e.skipped_streak, e.loss_scale) == (5, "skipped_streak", 3, 1.0)
    assert (
        "step 5: 3 consecutive steps skipped for fp16 overflow (train.max_skipped_steps=3), last loss=5, "
        "gradient norm=nan, loss scale=1"
    ) in str(e)
    assert "lower zero.loss_scale_init; or allow a longer streak with train.max_skipped_steps" in str(e)


def test_fp16_warns_once_when_a_streak_reaches_half_the_limit():
    g = DivergenceGuard(loss_scaling=True, max_skipped_steps=6)
    notes = [g.check(s, 5.0, NAN, True, loss_scale=2.0**-s) for s in range(1, 6)]
    assert [n is not None for n in notes] == [False, False, True, False, False]
    assert notes[2].startswith("3 consecutive steps skipped for fp16 overflow up to step 3")


def test_fp16_non_finite_loss_on_an_applied_step_stops_at_once():
    g = DivergenceGuard(loss_scaling=True, max_skipped_steps=50)
    with pytest.raises(DivergenceError, match="step 1: loss=nan, gradient norm=0.5"):
        g.check(1, NAN, 0.5, False, loss_scale=65536.0)


def test_final_warning_only_when_no_step_made_an_update():
    g = DivergenceGuard(loss_scaling=True, max_skipped_steps=50)
    for s in range(1, 4):
        g.check(s, 5.0, NAN, True)
    assert g.final_warning().startswith("all 3 steps of this run were skipped for fp16 overflow")
    g.check(4, 5.0, 1.0, False)
    assert g.final_warning() is None
    assert DivergenceGuard(loss_scaling=False).final_warning() is None  # nothing checked yet


def test_record_is_strict_json_and_round_trips():
    g = DivergenceGuard(loss_scaling=False)
    with pytest.raises(DivergenceError) as ei:
        g.check(7, INF, NAN, True, loss_scale=1.0)
    rec = json.loads(json.dumps(ei.value.with_note("Saved: step 5.").record(), allow_nan=False))
    assert rec["loss"] == "inf" and rec["grad_norm"] == "nan" and rec["step"] == 7
    back = DivergenceError.from_record(rec)
    assert str(back) == str(ei.value) + " Saved: step 5."
    assert back.step == 7 and math.isinf(back.loss) and math.isnan(back.grad_norm) and back.reason == "non_finite"


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_the_limit_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="max_skipped_steps >= 1"):
        DivergenceGuard(loss_scaling=True, max_skipped_steps=bad)
