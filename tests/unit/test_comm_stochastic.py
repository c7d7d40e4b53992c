"""Stochastic rounding through the quantized collectives (``QuantSpec(rounding="stochastic")``, seed rule of
``zeropp.comm.stochastic``): the collectives use exactly the documented kernel seed per
(seed, global rank, call index, hop); the result is unbiased where round-to-nearest has a fixed
bias; noise differs across calls and ranks and replays after resetting the call counter.

One 2-rank world (single-hop paths) and one 2x2 world (hierarchical qgZ, whose re-quantization
is hop 1). Everything is seeded, so every assertion is deterministic.

Here: the one-process checks of this topic; its other tiers' checks are in
``tests/distributed/test_comm_stochastic.py``.
"""

from __future__ import annotations

import pytest

from tests.stochastic_specs import SEED, sr_spec
from zeropp.comm import stochastic_seed


def test_plugin_settings_validate_the_seed():
    from zeropp.comm.ddp import QuantizedAllReduceState
    from zeropp.comm.fsdp import QuantizedAllGather, QuantizedReduceScatter

    assert QuantizedAllReduceState(grads=sr_spec(4, seed=3)).grads.stochastic
    for make in (
        lambda: QuantizedAllGather(sr_spec(8, seed=-1)),
        lambda: QuantizedReduceScatter(sr_spec(4, seed=2**63)),
        lambda: QuantizedAllReduceState(grads=sr_spec(4, seed=-5)),
    ):
        with pytest.raises(ValueError, match=r"\[0, 2\*\*63\)"):
            make()
    assert stochastic_seed(None, 0, 0) == stochastic_seed(0, 0, 0)
    seeds = {stochastic_seed(SEED, r, c, h) for r in range(4) for c in range(4) for h in range(2)}
    assert len(seeds) == 32 and all(0 <= s < 2**63 for s in seeds)
