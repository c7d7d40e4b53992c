"""The tolerance bands of quantized training against the unquantized run, shared by the tests that
train with a quantization recipe (``tests/distributed/test_runtime_zeropp.py`` states and measures
them; ``tests/distributed/test_runtime_formats.py`` holds the float formats to the same bands).

Over ``STEPS`` steps of the tiny GPT (its own head weight, ``CFG``) on English text at ``LR``,
where the loss falls by more than 0.5, every step's loss stays within ``TOL_8BIT`` (8-bit only)
or ``TOL_4BIT`` (anything with 4 bits) of the unquantized run's loss at the same step, relative."""

from tests.runtime_helpers import TINY

STEPS, LR = 8, 1e-2
TOL_8BIT, TOL_4BIT = 0.01, 0.03
CFG = TINY.with_(tie_embeddings=False)
"""The GPT with its own head weight (tied, INT4 qwZ quantizes embedding and head with one error)."""


def within_band(losses: list[float], base: list[float], tol: float) -> list[tuple[int, float, float]]:
    """The steps whose loss is off the unquantized run's by more than ``tol`` (relative): none
    when the run is within the band."""
    return [(s, a, b) for s, (a, b) in enumerate(zip(losses, base)) if abs(a - b) > tol * b]
