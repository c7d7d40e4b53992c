"""The stochastic-rounding spec of the collectives' tests, built as the old ``bits=...,
stochastic=..., seed=...`` knobs did, and the seed those tests use."""

from __future__ import annotations

from zeropp.comm.spec import QuantSpec

SEED = 1234
"""The seed of every stochastic spec and reference in these tests."""


def sr_spec(bits: int, group_size=None, seed: int = SEED, intra_bits=None, stochastic: bool = True) -> QuantSpec:
    """The spec of the old ``bits=..., stochastic=..., seed=...`` knobs."""
    return QuantSpec(
        bits=bits,
        group_size=group_size,
        intra_bits=intra_bits,
        seed=seed,
        rounding="stochastic" if stochastic else "nearest",
    )
