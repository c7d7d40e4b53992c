"""The nvme tier: swap files, bounded staging, failures, checkpoints and host memory.

Here: the gloo-world checks. The topic's full description and its one-process checks are in
``tests/unit/test_runtime_swap.py``.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import tempfile

import pytest

from tests.runtime_helpers import make_model, rank_batches, tiny_tmpfs
from tests.worlds import run_world
from zeropp.runtime import OptimizerConfig
from zeropp.runtime.swap import SwapError, SwapSpace


def test_a_real_full_disk_fails_at_creation(tmp_path):
    with tiny_tmpfs(tmp_path) as d:
        sp = SwapSpace(d, 0, buffers=2, buffer_size=16)
        with pytest.raises(SwapError, match=r"cannot preallocate swap file .*big\.swp.*disk .* is full") as e:
            sp.create("big.swp", 1 << 20)
        assert e.value.errno == errno.ENOSPC
        sp.close()


# ---------------------------------------------------------------------------------- engine
def _engine(kw, nvme, rank, world):
    from zeropp.runtime import ZeroConfig, ZeroEngine

    if "nvme" in (kw.get("offload_optimizer"), kw.get("offload_param")):
        kw = dict(kw, nvme_path=nvme)
    return ZeroEngine(make_model(), config=ZeroConfig(**kw), optimizer=OptimizerConfig(lr=1e-2), cpu_adam="single")


def _checkpoint_world(rank: int, world: int, ck: str) -> dict:
    import zeropp.runtime.swap as swap

    out: dict = {}
    base = dict(stage=3, precision="fp32")
    nvme_kw = dict(base, offload_optimizer="nvme", offload_param="nvme", swap_buffer_size=500)
    with tempfile.TemporaryDirectory() as nvme:
        eng = _engine(nvme_kw, nvme, rank, world)
        out["run"] = [eng.train_step(rank_batches(s, 1, rank)).loss for s in range(2)]
        eng.save_checkpoint(ck)
        out["run"] += [eng.train_step(rank_batches(s, 1, rank)).loss for s in (2, 3)]
        real = swap._write_at

        def full(fd, data, offset):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        swap._write_at = full
        try:
            eng.train_step(rank_batches(4, 1, rank))
        except SwapError as exc:
            out["error"] = str(exc)
        finally:
            swap._write_at = real
        eng.close()
        out["left"] = os.listdir(nvme)
        for name, kw in (
            ("nvme", nvme_kw),
            ("cpu", dict(base, offload_optimizer="cpu", offload_param="cpu")),
            ("memory", base),
            ("stage2_nvme", dict(stage=2, precision="fp32", offload_optimizer="nvme")),
        ):
            eng = _engine(kw, nvme, rank, world)
            eng.load_checkpoint(ck)  # the checkpoint saved before the failed swap is intact
            out[name] = [eng.train_step(rank_batches(s, 1, rank)).loss for s in (2, 3)]
            eng.close()
    return out


def test_checkpoint_round_trip_and_a_full_disk_keeps_the_last_checkpoint(tmp_path):
    r = run_world(_checkpoint_world, 2, str(tmp_path), timeout=120)[0]
    assert "optimizer.swp" in r["error"] and "No space left on device" in r["error"], r.get("error")
    assert r["left"] == []  # close removed the swap files
    for name in ("nvme", "cpu", "memory"):  # same stage, same arithmetic: the same losses as uninterrupted
        assert r[name] == r["run"][2:], (name, r[name], r["run"])
    # another stage reshards the same state: the same run up to the reduction order
    assert all(abs(a - b) < 1e-5 for a, b in zip(r["stage2_nvme"], r["run"][2:])), r["stage2_nvme"]


# ---------------------------------------------------------------------------------- host memory
_RSS_SCRIPT = r"""
import ctypes, gc, os, sys, tempfile, torch, torch.distributed as dist
from zeropp.models import GPT, GPTConfig
from zeropp.runtime import OptimizerConfig, ZeroConfig, ZeroEngine
torch.set_num_threads(1)
def rss():
    gc.collect(); ctypes.CDLL("libc.so.6").malloc_trim(0)
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
cfg = GPTConfig(d_model=256, n_layers=int(sys.argv[1]), n_heads=4, seq_len=8)
torch.manual_seed(0)
model = GPT(cfg)
before = rss()
with tempfile.TemporaryDirectory() as d:
    eng = ZeroEngine(model, config=ZeroConfig(stage=3, precision="bf16", offload_optimizer="nvme", offload_param="nvme",
                     nvme_path=d, swap_buffers=2, swap_buffer_size=1 << 16), optimizer=OptimizerConfig())
    del model
    x = torch.randint(0, 256, (2, 9))
    for _ in range(2):
        eng.train_step([(x[:, :-1], x[:, 1:])])
    after = rss()
    device = sum(eng.memory_report()[k] for k in ("params", "grads"))
    print(eng.num_params, after - before, device, eng.optim.memory_by_tier()["disk"])
    eng.close()
dist.destroy_process_group()
"""


def _rss_run(layers: int, port: int) -> tuple[int, int, int, int]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    p = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(layers), str(port)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    return tuple(int(x) for x in p.stdout.split()[-4:])


def test_nvme_host_memory_stays_bounded_when_the_model_grows_4x():
    small = _rss_run(2, 29511)
    big = _rss_run(8, 29512)
    assert big[0] > 3.5 * small[0]  # the model grew ~4x
    # host memory the run added beyond what the compute device holds (on a CPU run the "device"
    # is this process's memory too): staging buffers and transients, not the optimizer state
    extra_small, extra_big = small[1] - small[2], big[1] - big[2]
    grown_state = big[3] - small[3]  # bytes of optimizer state that moved to disk as the model grew
    assert grown_state > 50e6
    assert extra_big - extra_small < 0.1 * grown_state, (small, big)
