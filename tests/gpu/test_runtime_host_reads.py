"""The engine reads one device value back per training step.

A read of a device tensor on the host (``float(loss)``, ``.item()``, ``.tolist()``) waits for
every kernel queued before it, so a read per micro-step or per unit keeps the host from queueing
work ahead of the GPU. The rule (``engine.py``, ``update.py``): the loss and the squared norms stay
on the device and the step reads them once, together (``ParamUpdate.read_totals``); the checks
every rank must pass between forward and backward exchange host ints on a host group
(``batch.host_max``), never device values. Counted here on CPU with ``tests/host_reads.py`` (every
read library code makes), so a new read on the hot path fails without a GPU; ``cuda`` tests count
the synchronizations the CUDA runtime itself reports.

Here: the CUDA checks of this topic; its other tiers' checks are in
``tests/unit/test_runtime_host_reads.py``, ``tests/distributed/test_runtime_host_reads.py``.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.runtime_helpers import make_model, nccl_world, rank_batches
from tests.worlds import run_world


def _cuda_syncs(rank: int, world: int, store_path: str, stage: int) -> list[tuple[str, int]]:
    """One NCCL rank on GPU 0 (run_world starts a gloo world; swapped as in test_runtime_cuda.py):
    the synchronizing calls library code makes during a step after the first, as the CUDA
    runtime reports them (``set_sync_debug_mode("warn")``), by file and line."""
    from tests.host_reads import ROOTS
    from zeropp.runtime import OptimizerConfig, ZeroConfig, ZeroEngine

    nccl_world(rank, world, store_path)
    cfg = ZeroConfig(stage=stage, grad_accum_steps=2, grad_clip=1.0)
    eng = ZeroEngine(make_model().cuda(), config=cfg, optimizer=OptimizerConfig(lr=1e-3))
    try:
        batches = [(i.cuda(), t.cuda()) for i, t in rank_batches(0, 2, rank)]
        eng.train_step(batches)  # the first step builds what later steps reuse
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                eng.train_step(batches)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return [
            (str(w.filename), w.lineno)
            for w in caught
            if "synchroniz" in str(w.message)
            and str(w.filename).startswith(ROOTS)
            and not str(w.filename).endswith("streams.py")
        ]
    finally:
        eng.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("stage", [0, 3])
def test_on_cuda_the_library_synchronizes_once_per_step(stage, tmp_path):
    """The CUDA runtime reports every synchronizing call with the Python line that made it. Those
    made by library code during a step: one, the read in ``update.py``. (The comm-wait timing,
    ``streams.CommStreams.blocked_s``, waits for the step's last timing event when
    ``StepResult.comm_wait_s`` is filled in, at the very end of the step; it is a measurement, not
    on the path between forward and backward, and not counted.)"""
    (syncs,) = run_world(_cuda_syncs, 1, str(tmp_path / "store"), stage, timeout=300)
    assert len(syncs) == 1 and syncs[0][0].endswith("update.py"), syncs


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_an_nvme_fetch_does_not_wait_for_the_compute_stream(tmp_path):
    """``SwapSpace.read_to`` on CUDA: the chunks go through pinned buffers on a copy stream, so
    the host returns while the compute stream is still busy (a 1 s ``torch.cuda._sleep``), and
    the tensor, read on the compute stream, holds the segment's values. One read comes first, as
    a training step's earlier fetches would: a process's first read waits for the device once (on
    an H200, 2026-11-27: 1,045 ms under the 1 s sleep, then 2.7 and 3.5 ms; a fresh 12 MiB
    allocation on a side stream alone took 0.4 ms, so it is the copy path's one-time setup, not
    the caching allocator growing)."""
    from zeropp.runtime.swap import Segment, SwapSpace

    sp = SwapSpace(tmp_path, 0, buffers=2, buffer_size=1000, pin=True)
    try:
        src = torch.randn(10_007)
        seg = Segment(sp.create("p.swp", src.numel() * 4), 0, src.numel(), torch.float32)
        sp.write_from(seg, src)
        warm = sp.read_to(seg, "cuda")  # the process's first read, which waits for the device once
        torch.cuda.synchronize()
        del warm
        torch.cuda._sleep(2_000_000_000)  # about 1 s of GPU clock cycles on the compute stream
        slept = torch.cuda.Event()
        slept.record()
        out = sp.read_to(seg, "cuda")
        assert not slept.query()  # back on the host while the compute stream still sleeps
        assert torch.equal(out.cpu(), src)
    finally:
        sp.close()
