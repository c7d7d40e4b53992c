"""The engine reads one device value back per training step.

Here: the one-process checks. The topic's full description and its CUDA checks are in
``tests/gpu/test_runtime_host_reads.py``; its gloo-world checks are in
``tests/distributed/test_runtime_host_reads.py``.
"""

from __future__ import annotations

import torch

from tests.host_reads import HostRead, host_reads


def test_the_counter_sees_library_reads_and_only_those():
    """The counter's own reference: a read in library code (``byte_batch``'s ``starts.tolist()``)
    is recorded with its place; the same call made here, or inside torch, is not; the methods are
    restored afterwards."""
    from zeropp.models.gpt import byte_batch

    before = torch.Tensor.__dict__.get("tolist")
    t = torch.arange(3.0)
    with host_reads() as reads:
        byte_batch(bytes(range(64)), 2, 8, torch.Generator().manual_seed(0))
        t.tolist(), float(t[0]), bool(t[1])
        torch.nn.utils.clip_grad_norm_([torch.nn.Parameter(t.clone())], 1.0, error_if_nonfinite=True)
    assert reads == [HostRead("zeropp/models/gpt.py:byte_batch", "tolist", "cpu")]
    assert torch.Tensor.__dict__.get("tolist") is before and float(t[2]) == 2.0
