"""ZeRO-R: activation checkpointing, activation offload and the constant buffer pool.

Here: the CUDA checks. The topic's full description and its one-process checks are in
``tests/unit/test_runtime_zero_r.py``; its gloo-world checks are in
``tests/distributed/test_runtime_zero_r.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.runtime_helpers import TINY, check_offload_model_host_bytes, make_model, rank_batches


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offload_to_pinned_host_on_cuda_is_exact():
    from zeropp.runtime.activations import ActivationStore, checkpoint_blocks

    torch.manual_seed(0)
    model = make_model(TINY).cuda()
    idx, tgt = (t.cuda() for t in rank_batches(0, 1, 0)[0])
    _, loss = model(idx, tgt)
    loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    for ckpt in (False, True):
        model.zero_grad(set_to_none=True)
        handle = checkpoint_blocks(list(model.blocks)) if ckpt else None
        store = ActivationStore(torch.device("cuda"), offload=True)
        with store.saving():
            _, loss2 = model(idx, tgt)
        tiers = store.memory_by_tier()
        assert tiers["host"] > 0 and tiers["device"] == 0, tiers
        loss2.backward()
        assert torch.equal(loss, loss2)
        for n, p in model.named_parameters():
            assert torch.equal(p.grad, ref[n]), n
        if handle is not None:
            handle.remove()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offload_model_host_bytes_equal_device_bytes_on_cuda():
    check_offload_model_host_bytes("cuda")
