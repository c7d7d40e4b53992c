"""Pieces of the runtime: config validation, partitioning, the sharded AdamW.

Here: the gloo-world checks. The topic's full description and its one-process checks are in
``tests/unit/test_runtime_units.py``.
"""

import pytest
import torch

from tests.runtime_helpers import make_model
from zeropp.comm.spec import QuantSpec


def _fp16_mean_world(rank: int, world: int) -> dict:
    from zeropp.comm import CommStats, Topology
    from zeropp.runtime.collectives import EngineComm

    comm = EngineComm(Topology(nodes=1, ranks_per_node=world), CommStats())
    full = torch.full((world * 256,), 40000.0, dtype=torch.float16)  # every rank's gradient: 40000
    res = {}
    for bits in (8, 4):
        out = torch.empty(256, dtype=torch.float16)
        comm.reduce_scatter(
            out, full, spec=QuantSpec(bits=bits), bucket=10**9, kind="grad_reduce_scatter", async_op=False
        )
        res[bits] = out.float().tolist()
    return res


def test_quantized_gradient_mean_does_not_overflow_fp16_when_the_mean_fits():
    """The mean of two ranks' 40000 is 40000, well inside fp16; their sum (80000) is not. The
    engine's quantized reduce-scatter used to round the fp32 sum into fp16 (inf) and divide after."""
    from tests.worlds import run_world

    for res in run_world(_fp16_mean_world, 2, timeout=60):
        for bits, vals in res.items():
            assert all(abs(v - 40000.0) <= 40000.0 / (2 * (2 ** (bits - 1) - 1)) for v in vals), (bits, vals[:4])


def _frozen_world(rank: int, world: int, stage: int) -> dict:
    from zeropp.comm import Topology
    from zeropp.runtime import ZeroConfig, ZeroEngine

    model = make_model(seed=rank)  # ranks build different weights on purpose
    model.pos_emb.weight.requires_grad_(False)
    rank0 = make_model(seed=0).pos_emb.weight.detach().clone()
    eng = ZeroEngine(model, config=ZeroConfig(stage=stage, precision="bf16"), topology=Topology(1, world))
    try:
        sd = eng.consolidated_state_dict()
        return {
            "compute": model.pos_emb.weight.detach().float().numpy(),
            "exported": sd["pos_emb.weight"].float().numpy(),
            "exported_dtype": str(sd["pos_emb.weight"].dtype),
            "rank0": rank0.numpy(),
        }
    finally:
        eng.close()


@pytest.mark.parametrize("stage", [2, 3])
def test_frozen_parameters_start_identical_and_export_unrounded(stage: int):
    """Frozen parameters were neither broadcast (ranks kept their own values, though trained ones
    start from rank 0's) nor exported in their own dtype (consolidated_state_dict returned the
    bf16-rounded copy). Stage 2 keeps them replicated (every rank's compute copy is rank 0's,
    rounded); stage 3 shards them (between gathers the module holds an empty tensor)."""
    from tests.worlds import run_world

    res = run_world(_frozen_world, 2, stage, timeout=60)
    for r in res:
        assert r["exported_dtype"] == "torch.float32"
        assert (r["exported"] == r["rank0"]).all()  # exactly rank 0's fp32 values
        if stage == 2:  # the bf16 compute copies are rank 0's values on every rank
            assert r["compute"].shape == r["rank0"].shape
            assert (r["compute"] == torch.from_numpy(r["rank0"]).bfloat16().float().numpy()).all()
        else:
            assert r["compute"].size == 0
