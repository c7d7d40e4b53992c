"""Frozen parameters at every stage, sharded at stage 3, and MixZ++ (``quantize_frozen``).

Here: the one-process checks. The topic's full description and its gloo-world checks are in
``tests/distributed/test_runtime_frozen.py``.
"""

from __future__ import annotations

import pytest


# ---------------------------------------------------------------------- bad input
def test_quantize_frozen_is_validated() -> None:
    from zeropp.runtime import ZeroConfig

    for stage in (0, 1, 2):
        with pytest.raises(ValueError, match=r"quantize_frozen='int8'.*stage=3"):
            ZeroConfig(stage=stage, quantize_frozen="int8")
    with pytest.raises(ValueError, match=r"quantize_frozen='fp8'.*'none', 'int8', 'int4'"):
        ZeroConfig(stage=3, quantize_frozen="fp8")
    assert ZeroConfig(stage=3, quantize_frozen="int4").quantize_frozen == "int4"
    assert ZeroConfig(stage=1).quantize_frozen == "none"
