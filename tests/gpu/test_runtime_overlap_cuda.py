"""Overlap on CUDA: the engine's side streams give the same results as issuing everything on
the compute stream, the blocked time is the compute stream's real stall (timing events), and
the DDP hook's device-aware future gives stock DDP's result. Needs a GPU (world 1 under NCCL;
qgZ's asynchronous cross-node hop with 4 GPUs as 2 emulated nodes of 2)."""

import os
import tempfile

import numpy as np
import pytest
import torch

from tests.worlds import run_world

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def test_blocked_time_is_the_compute_streams_stall() -> None:
    from zeropp.runtime.streams import CommStreams

    dev = torch.device("cuda", 0)
    st = CommStreams(dev)
    assert st.enabled
    x = torch.ones(1 << 20, device=dev)
    with st.issuing("all_gather", (x,)):
        torch.cuda._sleep(50_000_000)  # tens of ms of GPU time on the side stream
        y = x * 2
        ev = st.record("all_gather")
    st.wait(ev)  # the compute stream stalls until the side stream is done
    z = y + 1
    stalled = st.blocked_s()
    assert torch.equal(z, torch.full_like(x, 3.0))
    assert stalled > 0.005, stalled
    st.reset()
    torch.cuda.synchronize()
    with st.issuing("reduce_scatter"):
        ev = st.record("reduce_scatter")
    torch.cuda.synchronize()
    st.wait(ev)  # already done: (almost) no stall
    assert st.blocked_s() < stalled / 5


def _nccl(rank: int, world: int, store: str) -> None:
    import torch.distributed as dist

    dist.destroy_process_group()
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", store=dist.FileStore(store, world), rank=rank, world_size=world, device_id=torch.device("cuda", rank)
    )


def _streams_vs_none(rank: int, world: int, store: str) -> dict:
    _nccl(rank, world, store)
    from tests.runtime_helpers import make_model, rank_batches
    from zeropp.comm import QuantSpec, Topology
    from zeropp.runtime import OptimizerConfig, ZeroConfig, ZeroEngine
    from zeropp.runtime.streams import CommStreams

    out = {}
    for cfg in (
        ZeroConfig(stage=3),
        ZeroConfig(stage=3, weights=QuantSpec(bits=8), grads=QuantSpec(bits=4)),
        ZeroConfig(stage=2, reduce_bucket_size=300),
    ):
        runs = []
        for streams in (True, False):
            eng = ZeroEngine(
                make_model().cuda(), config=cfg, optimizer=OptimizerConfig(lr=1e-3), topology=Topology(1, world)
            )
            assert eng.comm.streams.enabled
            if not streams:
                eng.comm.streams = CommStreams(eng.device, use_streams=False)
            res = [eng.train_step([(i.cuda(), t.cuda()) for i, t in rank_batches(s, 1, rank)]) for s in range(3)]
            w = {k: v.numpy() for k, v in eng.consolidated_state_dict().items()}
            eng.close()
            assert all(r.comm_wait_s >= 0 for r in res)
            runs.append(([r.loss for r in res], w))
        (l1, w1), (l0, w0) = runs
        out[repr(cfg)] = l1 == l0 and all(np.array_equal(w1[k], w0[k]) for k in w0)
    return out


def test_engine_side_streams_match_the_compute_stream() -> None:
    with tempfile.TemporaryDirectory() as d:
        res = run_world(_streams_vs_none, 1, os.path.join(d, "store"), timeout=300)
    assert all(all(r.values()) for r in res), res


def _qgz_async(rank: int, world: int, store: str) -> bool:
    _nccl(rank, world, store)
    from tests.comm_helpers import rank_input
    from zeropp.comm import QuantSpec, Topology, quantized_reduce_scatter

    topo, dev = Topology(2, world // 2), torch.device("cuda", rank)
    sizes = [1, 7, 257]
    xs = [rank_input(60, rank, world * n, torch.float32).to(dev) for n in sizes]
    sync = [torch.empty(n, device=dev) for n in sizes]
    for o, x in zip(sync, xs):
        quantized_reduce_scatter(o, x, spec=QuantSpec(bits=4), topology=topo)
    outs = [torch.empty(n, device=dev) for n in sizes]
    hs = [
        quantized_reduce_scatter(o, x, spec=QuantSpec(bits=4), topology=topo, async_op=True) for o, x in zip(outs, xs)
    ]
    for h in reversed(hs):
        h.wait()
    return all(torch.equal(a, b) for a, b in zip(outs, sync))


@pytest.mark.skipif(GPUS < 4, reason="needs 4 GPUs (2 emulated nodes of 2)")
def test_outstanding_qgz_on_nccl_equal_synchronous() -> None:
    with tempfile.TemporaryDirectory() as d:
        assert run_world(_qgz_async, 4, os.path.join(d, "store"), timeout=300) == [True] * 4


def _ddp(rank: int, world: int, store: str) -> bool:
    _nccl(rank, world, store)
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zeropp.comm.ddp import QuantizedAllReduceState, quantized_allreduce_hook

    params = []
    for hooked in (False, True):
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(17, 33), nn.GELU(), nn.Linear(33, 5)).cuda(), device_ids=[rank])
        if hooked:
            model.register_comm_hook(QuantizedAllReduceState(grads=None), quantized_allreduce_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for s in range(3):
            g = torch.Generator().manual_seed(s * 10 + rank)
            x, y = torch.randn(8, 17, generator=g).cuda(), torch.randn(8, 5, generator=g).cuda()
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        params.append([p.detach().cpu() for p in model.parameters()])
    return all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(*params))


def test_ddp_hook_future_on_cuda_tracks_stock_ddp() -> None:
    with tempfile.TemporaryDirectory() as d:
        assert run_world(_ddp, 1, os.path.join(d, "store"), timeout=300) == [True]
