"""A forward (or loss) that raises on one rank only, at stages 0-2: every rank raises the same
error right after the forward (no rank waits in a collective until the timeout), in training and
evaluation, and the world is usable afterwards. (Stage 3's own check: tests/distributed/test_runtime_wrap.py.)

Here: the one-process checks of this topic; its other tiers' checks are in
``tests/distributed/test_runtime_forward_errors.py``.
"""

from __future__ import annotations

from zeropp.runtime.batch import agree_on_forward


def test_one_process_reraises_the_models_own_error() -> None:
    err = ValueError("x")
    try:
        agree_on_forward(err)
    except ValueError as e:
        assert e is err
    agree_on_forward(None)
