"""A forward (or loss) that raises on one rank only, at stages 0-2: every rank raises the same error.

Here: the one-process checks. The topic's full description and its gloo-world checks are in
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
