"""The engine reads one device value back per training step.

A read of a device tensor on the host (``float(loss)``, ``.item()``, ``.tolist()``) waits for
every kernel queued before it, so a read per micro-step or per unit keeps the host from queueing
work ahead of the GPU. The rule (``engine.py``, ``update.py``): the loss and the squared norms stay
on the device and the step reads them once, together (``ParamUpdate.read_totals``); the checks
every rank must pass between forward and backward exchange host ints on a host group
(``batch.host_max``), never device values. Counted here on CPU with ``tests/host_reads.py`` (every
read library code makes), so a new read on the hot path fails without a GPU; ``cuda`` tests count
the synchronizations the CUDA runtime itself reports.

Here: the one-process checks of this topic; its other tiers' checks are in
``tests/distributed/test_runtime_host_reads.py``, ``tests/gpu/test_runtime_host_reads.py``.
"""

from __future__ import annotations

import torch

from tests.host_reads import HostRead, host_reads

"""The step's one read: the all-reduced [loss, squared norms]."""

"""The per-micro-step agreement of host ints: a tensor made on the host from Python ints."""


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
