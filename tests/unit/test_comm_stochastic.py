"""Stochastic rounding through the quantized collectives (``QuantSpec(rounding="stochastic")``, the
seed rule of ``zeropp.comm.stochastic``).

Here: the one-process checks. The topic's full description and its gloo-world checks are in
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
