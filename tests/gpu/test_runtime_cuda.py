"""Engine stages 0-3 on CUDA under NCCL: fp32 parity with single-process training on the same GPU
(world 1; world 2 when two GPUs exist), with the CPU parity test's helpers and bounds. Every
tensor the engine hands to NCCL (gradients, weights, the loss/norm scalars, stage 3's
blocks-ran check) must live on the GPU, or NCCL refuses it: these runs check that too."""

import os
import tempfile

import pytest
import torch

from tests.parity_helpers import LR, STAGES, STEPS, check_parity
from tests.runtime_helpers import nccl_world, parity_world
from tests.worlds import run_world

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _nccl_world(rank, world, store_path, configs, steps, ckpt_dir):
    """run_world starts a gloo world; swap it for an NCCL one on this rank's GPU (FileStore
    rendezvous), train, then check a checkpoint round trip on the GPU."""
    nccl_world(rank, world, store_path)
    out = parity_world(rank, world, 1, configs, steps, device=f"cuda:{rank}")
    from tests.runtime_helpers import make_model, rank_batches
    from zeropp.runtime import OptimizerConfig, ZeroConfig, ZeroEngine

    eng = ZeroEngine(make_model().cuda(), config=ZeroConfig(stage=3), optimizer=OptimizerConfig(lr=LR))
    batches = [(i.cuda(), t.cuda()) for i, t in rank_batches(0, 1, rank)]
    eng.train_step(batches)
    eng.save_checkpoint(ckpt_dir, extra={"step": 1})
    before = eng.eval_loss(*batches[0])
    eng.train_step(batches)
    extra = eng.load_checkpoint(ckpt_dir)
    after = eng.eval_loss(*batches[0])
    eng.close()
    out.append({"ckpt": (extra, before, after)})  # every rank: _run takes it off each rank's list
    return out


def _run(world):
    with tempfile.TemporaryDirectory() as d:
        res = run_world(
            _nccl_world, world, os.path.join(d, "store"), STAGES, STEPS, os.path.join(d, "ckpt"), timeout=300
        )
    for rank, r in enumerate(res):
        ckpt = r.pop()["ckpt"]
        assert ckpt[0] == {"step": 1} and ckpt[1] == ckpt[2], (rank, ckpt)  # load restores the saved weights exactly
    return res


def test_stages_match_single_process_on_cuda_world1():
    check_parity(_run(1), 1, STAGES, device="cuda:0")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_stages_match_single_process_on_cuda_world2():
    check_parity(_run(2), 2, STAGES, device="cuda:0")
