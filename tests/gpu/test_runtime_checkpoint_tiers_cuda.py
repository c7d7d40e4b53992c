"""Offload checkpoints on two GPUs (NCCL): the host and nvme tiers never come to the GPU.

Per rank, the fp32 optimizer state of ``MODEL`` is ``12 * P / 2`` bytes (P = 3.23M parameters:
master and both moments, sharded over 2 ranks), 18.5 MiB. Saving it through DTensors on the CUDA
mesh (the earlier code) moved it all to the GPU (+18.5 MiB), and its load held about two more
copies there (+37 MiB). Now the GPU allocates, during a save and a load of an offloaded state, only
the agreement flags and DCP's pickled plans in NCCL's object collectives (KBs; the model has no
buffers or frozen parameters to load): ``MARGIN`` = 1 MiB bounds them with room to spare, under a
tenth of what the earlier code added. The in-memory run's training peak is the reference the
offloaded loads stay under.
"""

import os
import tempfile

import pytest
import torch

from tests.worlds import run_world
from zeropp.models import GPTConfig

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL world of 2)"
    ),
]

MODEL = GPTConfig(d_model=256, n_layers=4, n_heads=4, seq_len=16)
MARGIN = 1 << 20
CONFIGS = {"memory": {}, "cpu": dict(offload_optimizer="cpu"), "nvme": dict(offload_optimizer="nvme")}


def _peak(fn, *args) -> tuple[int, int]:
    """(GPU bytes allocated before ``fn(*args)``, peak bytes allocated while it ran)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn(*args)
    torch.cuda.synchronize()
    return before, torch.cuda.max_memory_allocated()


def _world(rank, world, store_path, root):
    import torch.distributed as dist

    from tests.runtime_helpers import make_model, nccl_world, rank_batches
    from zeropp.runtime import OptimizerConfig, ZeroConfig, ZeroEngine

    nccl_world(rank, world, store_path)
    out = {}
    for name, kw in CONFIGS.items():
        if kw.get("offload_optimizer") == "nvme":
            nvme = os.path.join(root, f"swap{rank}")
            os.makedirs(nvme, exist_ok=True)  # ZeroConfig refuses an nvme_path that is not an existing directory
            kw = dict(kw, nvme_path=nvme, swap_buffer_size=1 << 16)
        eng = ZeroEngine(
            make_model(MODEL).cuda(),
            config=ZeroConfig(stage=3, precision="fp32", **kw),
            optimizer=OptimizerConfig(lr=1e-2),
            cpu_adam="single",
        )
        batches = [[(i.cuda(), t.cuda()) for i, t in rank_batches(s, 1, rank, MODEL)] for s in range(3)]
        torch.cuda.reset_peak_memory_stats()
        for b in batches[:2]:
            eng.train_step(b)
        torch.cuda.synchronize()
        r = {"train_peak": torch.cuda.max_memory_allocated(), "state": eng.optim.nbytes()}
        ck = os.path.join(root, f"ck_{name}")
        saved = {
            (n, i): eng.optim.read_range(n, i, 0, eng.optim.numels[i]).clone()
            for n in eng.optim.STATE
            for i in range(len(eng.optim.numels))
        }
        r["before"], r["save_peak"] = _peak(eng.save_checkpoint, ck)
        eng.train_step(batches[2])
        r["before_load"], r["load_peak"] = _peak(eng.load_checkpoint, ck)
        r["exact"] = all(
            torch.equal(saved[(n, i)], eng.optim.read_range(n, i, 0, eng.optim.numels[i])) for n, i in saved
        )
        eng.close()
        out[name] = r
    dist.destroy_process_group()
    return out


def test_offload_checkpoints_keep_host_state_off_the_gpu():
    with tempfile.TemporaryDirectory() as root:
        res = run_world(_world, 2, os.path.join(root, "store"), root, timeout=300)
    for rank, r in enumerate(res):
        mem = r["memory"]
        for name in ("cpu", "nvme"):
            o = r[name]
            assert o["exact"], (rank, name)
            assert o["state"] > 10 * MARGIN, o  # the earlier code would have added it to the GPU
            # a save and a load allocate no more on the GPU than MARGIN besides what it held before
            assert o["save_peak"] <= o["before"] + MARGIN, (rank, name, o)
            assert o["load_peak"] <= o["before_load"] + MARGIN, (rank, name, o)
            assert o["load_peak"] <= mem["train_peak"] + MARGIN, (rank, name, o, mem)
        assert r["memory"]["exact"], rank
