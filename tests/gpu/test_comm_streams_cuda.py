"""Buffer lifetimes across CUDA streams (``zeropp/comm/lifetime.py``) on real GPUs.

The fault: a buffer allocated on the caller's stream and last used on another one (qgZ's hop-1
rows, read by the all-to-all its continuation waits on the chain's side stream) goes back to the
caller stream's pool as soon as Python drops it, and the caller's next allocation gets the same
memory while the other stream still reads it. Only the allocator's stream-use record
(``record_stream``) prevents that. The checks:

- one GPU: a buffer released on a busy side stream keeps its values while the caller writes its
  next same-size allocation, and a continuation reading a buffer its caller dropped at once reads
  the right values while the caller overwrites fresh allocations; each next to the same steps
  without the release, which do get overwritten (so the test is sensitive to the fault). Values,
  not addresses: a stream-ordered allocator may reuse an address safely;
- 4 GPUs (2 emulated nodes of 2): many outstanding hierarchical qgZ calls, with same-sized
  allocations written between them, equal the synchronous calls, with and without the streams
  debug mode; the runner with chunked qgZ (``zero.reduce_bucket_size`` small) tracks the
  unchunked run, in the debug mode too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from tests.worlds import run_world

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
SPIN = 50_000_000  # GPU cycles (tens of ms): the side stream is still busy when the caller allocates
NUMEL = 1 << 20  # 4 MiB of fp32: a large-pool block, reused at once by a same-size allocation
SEGMENT_NUMEL = 1 << 22  # 16 MiB of fp32: above the caching allocator's 10 MiB split limit, so the
# block is a segment of its own and the next same-size allocation gets exactly the freed block


# ------------------------------------------------------------------ one GPU
def _released_buffer_reads(dev: torch.device, release: bool) -> torch.Tensor:
    """A side stream reads ``t`` after a spin; the caller drops ``t`` at once (``release``: through
    ``Buffers.release`` on the side stream first) and writes its next same-size allocation. Returns
    what the side stream read. Judged by values, not pointers: a stream-ordered allocator
    (``backend:cudaMallocAsync``) may hand the same address out safely, ordered after the reader."""
    from zeropp.comm.lifetime import Buffers

    side = torch.cuda.Stream(dev)
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()  # no cached block of this size from earlier tests
    t = torch.full((SEGMENT_NUMEL,), 1.0, device=dev)  # on the caller's (current) stream
    out = torch.zeros(SEGMENT_NUMEL, device=dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        torch.cuda._sleep(SPIN)
        out.copy_(t)  # the side stream still reads t
        if release:
            Buffers(t).release()  # record_stream(side), then dropped
    del t
    fresh = torch.empty(SEGMENT_NUMEL, device=dev)  # the caller's next allocation ...
    fresh.fill_(7.0)  # ... written at once on the caller's stream
    torch.cuda.synchronize(dev)
    return out


def test_a_buffer_released_on_a_busy_stream_is_not_overwritten_by_the_caller_stream() -> None:
    dev = torch.device("cuda", 0)
    backend = torch.cuda.get_allocator_backend()
    assert bool((_released_buffer_reads(dev, release=True) == 1.0).all()), (
        f"the released buffer was overwritten while its stream still read it (allocator {backend})"
    )
    assert bool((_released_buffer_reads(dev, release=False) == 7.0).any()), (
        f"test setup: a plain drop should let the caller overwrite the block at once (allocator {backend})"
    )


def _continuation_reads(dev: torch.device, own: bool) -> torch.Tensor:
    """A continuation reads a buffer the caller drops at once (``own``: handed to it as its buffers)."""
    from zeropp.comm import chain
    from zeropp.comm.lifetime import Buffers

    src = torch.full((NUMEL,), 1.0, device=dev)
    out = torch.zeros(NUMEL, device=dev)
    box = [src]

    def job() -> None:  # like qgZ's hop 2: the last reference goes away inside the continuation
        s = box.pop()
        torch.cuda._sleep(SPIN)
        out.copy_(s)

    later = chain.submit(job, dev, buffers=Buffers(src, borrowed=(out,)) if own else None)
    del src
    scratch = torch.empty(NUMEL, device=dev)  # the caller's next allocation ...
    scratch.fill_(7.0)  # ... written at once on the caller's stream
    later.wait()
    torch.cuda.synchronize(dev)
    return out


def test_a_continuation_owning_its_buffers_reads_them_intact() -> None:
    dev = torch.device("cuda", 0)
    assert bool((_continuation_reads(dev, own=True) == 1.0).all())
    assert bool((_continuation_reads(dev, own=False) == 7.0).any()), "test setup: the unowned buffer was not reused"


# ------------------------------------------------------------------ 4 GPUs: hierarchical qgZ
def _nccl(rank: int, world: int, store: str) -> None:
    import torch.distributed as dist

    dist.destroy_process_group()
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", store=dist.FileStore(store, world), rank=rank, world_size=world, device_id=torch.device("cuda", rank)
    )


def _qgz_repeated(rank: int, world: int, store: str) -> dict[str, bool]:
    _nccl(rank, world, store)
    from tests.comm_helpers import rank_input
    from zeropp.comm import QuantSpec, Topology, context, quantized_reduce_scatter

    topo, dev = Topology(2, world // 2), torch.device("cuda", rank)
    spec = QuantSpec(bits=4, intra_bits=8)
    sizes = [1, 7, 257, 4099, 65537] * 3  # many outstanding, of sizes whose rows are reused
    xs = [rank_input(90 + k, rank, world * n, torch.float32).to(dev) for k, n in enumerate(sizes)]
    sync = [torch.empty(n, device=dev) for n in sizes]
    for o, x in zip(sync, xs):
        quantized_reduce_scatter(o, x, spec=spec, topology=topo)
    ctx, res = context.current(), {}
    for debug in (False, True):
        ctx.debug_streams = debug
        for rep in range(3):
            outs = [torch.empty(n, device=dev) for n in sizes]
            hs = []
            for o, x in zip(outs, xs):
                hs.append(quantized_reduce_scatter(o, x, spec=spec, topology=topo, async_op=True))
                torch.full((x.numel(),), 255, dtype=torch.uint8, device=dev)  # takes a freed block, writes it
            for h in reversed(hs) if rep % 2 else hs:
                h.wait()
            res[f"debug={debug} rep={rep}"] = all(torch.equal(a, b) for a, b in zip(outs, sync))
    return res


@pytest.mark.skipif(GPUS < 4, reason="needs 4 GPUs (2 emulated nodes of 2)")
def test_many_outstanding_qgz_on_nccl_equal_synchronous() -> None:
    from tests.streams_helpers import DEBUG_ENV

    with tempfile.TemporaryDirectory() as d:
        res = run_world(_qgz_repeated, 4, os.path.join(d, "store"), timeout=300, env=DEBUG_ENV)
    assert all(all(r.values()) for r in res), res


# ------------------------------------------------------------------ 4 GPUs: the runner, chunked qgZ
def _run(args: list[str], run_dir: Path, env: dict[str, str]) -> dict:
    e = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    e.update(env)
    p = subprocess.run(
        [sys.executable, "-m", "zeropp.experiments.run", *args, f"hydra.run.dir={run_dir}"],
        capture_output=True,
        text=True,
        timeout=300,
        env=e,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.skipif(GPUS < 4, reason="needs 4 GPUs (topology=2x2)")
def test_runner_with_chunked_qgz_on_2x2_tracks_the_unchunked_run(tmp_path: Path) -> None:
    base = [
        "trainer=zeropp",
        "quant=qgz",
        "topology=2x2",
        "launcher.device=cuda",
        "model=tiny",
        "train.steps=6",
        "train.micro_batch_size=4",
        "logger=none",
        "launcher.progress=false",
    ]
    whole = _run(base, tmp_path / "whole", {})
    chunked = ["zero.reduce_bucket_size=4096"]  # many chunks per unit: hop-1 rows allocated back to back
    runs = {
        "chunked": _run(base + chunked, tmp_path / "chunked", {}),
        "chunked_debug": _run(base + chunked, tmp_path / "debug", {"ZEROPP_DEBUG_STREAMS": "1"}),
    }
    ref = whole["loss"]["curve"]
    for name, s in runs.items():
        curve = s["loss"]["curve"]
        assert len(curve) == len(ref) and all(abs(a - b) <= 1e-3 * abs(b) for a, b in zip(curve, ref)), (
            name,
            curve,
            ref,
        )
