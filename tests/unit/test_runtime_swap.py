"""The nvme tier: swap files, bounded staging, failures, checkpoints and host memory.

References: a plain tensor round trip (what is written reads back bit for bit), the in-memory
``ShardedAdamW`` (the streamed step must give the same bits), the uninterrupted run (a checkpoint
saved with offloaded state resumes into any tier with the same losses), and the ZeRO-Infinity
claim that host memory does not grow with the model (measured RSS).

Here: the one-process checks of this topic; its other tiers' checks are in
``tests/distributed/test_runtime_swap.py``.
"""

from __future__ import annotations

import errno
import os

import pytest
import torch

from zeropp.runtime import OptimizerConfig, ShardedAdamW
from zeropp.runtime.offload import HostAdamW, SwappedAdamW
from zeropp.runtime.swap import Segment, SwapError, SwapSpace


@pytest.fixture
def space(tmp_path):
    sp = SwapSpace(tmp_path, 0, buffers=2, buffer_size=7)
    yield sp
    sp.close()


@pytest.mark.parametrize("numel", [1, 7, 17 * 257])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_through_bounded_buffers(space, numel, dtype):
    f = space.create("t.swp", 3 + numel * 2 * torch.empty(0, dtype=dtype).element_size())
    src = torch.randn(numel).to(dtype)
    seg = Segment(f, 3, numel, dtype)  # an odd byte offset: files are byte-addressed
    space.write_from(seg, src)  # a host tensor of the segment's dtype: straight to the file
    out = torch.empty(numel, dtype=dtype)
    space.read_into(seg, out)
    assert torch.equal(out, src)
    space.write_from(seg, src.double() + 1)  # another dtype: cast through the staging buffers
    out64 = torch.empty(numel, dtype=torch.float64)
    space.read_into(seg, out64)
    assert torch.equal(out64, (src.double() + 1).to(dtype).double())
    assert space.host_bytes() == 2 * 7 * 4  # whatever the tensor size


def test_files_are_preallocated_and_removed_on_close(tmp_path):
    sp = SwapSpace(tmp_path, 3, buffers=2, buffer_size=16)
    f = sp.create("a.swp", 12345)
    assert os.path.getsize(f.path) == 12345 and os.stat(f.path).st_blocks * 512 >= 12345
    assert sp.disk_bytes() == 12345 and os.path.basename(sp.dir).startswith("zeropp-swap-r3-")
    sp.close()
    assert os.listdir(tmp_path) == []
    sp.close()  # twice is fine
    with pytest.raises(RuntimeError, match="closed"):
        sp.read_into(Segment(f, 0, 1, torch.float32), torch.empty(1))


class _LateFence:
    """A copy out of a staging buffer that happens only when it is waited for: what a CUDA
    ``non_blocking`` copy from a pinned buffer is to the host (the GPU reads the buffer later)."""

    def __init__(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.dst, self.src, self.done = dst, src, False

    def synchronize(self) -> None:
        if not self.done:
            self.dst.copy_(self.src)
            self.done = True


class _LateCopies:
    """``SwapSpace._read_staged``'s copier, with every copy left in flight until its fence is waited for."""

    def __init__(self) -> None:
        self.fences: list[_LateFence] = []

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> _LateFence:
        self.fences.append(_LateFence(dst, src))
        return self.fences[-1]

    def finish(self, out: torch.Tensor) -> None:
        pass  # as on CUDA: the last copies are still running when the read returns


def test_a_staging_buffer_is_refilled_only_after_the_copy_out_of_it(tmp_path):
    """The asynchronous fetch (``read_to`` on CUDA) leaves each chunk's copy running; the next
    disk read into that buffer must wait for it, and closing the space waits for the last ones.
    With copies that read their buffer only when waited for, the result is still the segment
    bit for bit (a buffer refilled too early would hand over the next chunk's values); on CPU
    ``read_to`` gives the same values through the same loop."""
    sp = SwapSpace(tmp_path, 0, buffers=2, buffer_size=5)
    src = torch.randn(53)
    seg = Segment(sp.create("p.swp", src.numel() * 4), 0, src.numel(), torch.float32)
    sp.write_from(seg, src)
    out, late = torch.full((53,), float("nan")), _LateCopies()
    sp._read_staged(seg, out, late)
    assert len(late.fences) == 11 and not late.fences[-1].done  # 53 elements in chunks of 5, the last in flight
    assert torch.equal(sp.read_to(seg, "cpu"), src)  # a new read first waits for the buffer it takes
    sp.close()  # waits for every copy still reading a buffer
    assert all(f.done for f in late.fences) and torch.equal(out, src)


def test_a_space_whose_buffers_cannot_be_allocated_leaves_no_folder(tmp_path):
    with pytest.raises(RuntimeError, match="allocate"):
        SwapSpace(tmp_path, 0, buffers=2, buffer_size=2**60)  # 4 EiB staging buffers: the allocator refuses
    assert os.listdir(tmp_path) == []


def test_a_launched_rank_names_and_records_its_folder_and_an_unclosed_space_is_removed(tmp_path, monkeypatch):
    """Under zeropp's launcher the folder carries the run id and is recorded for the launcher's
    cleanup before it exists; a space dropped without close() is removed when collected."""
    import gc
    import json

    from zeropp import watch

    world, nvme = tmp_path / "world", tmp_path / "nvme"
    world.mkdir()
    nvme.mkdir()
    monkeypatch.setenv(watch.RUN_ID_ENV, "abc123def456")
    monkeypatch.setenv(watch.WORLD_DIR_ENV, str(world))
    monkeypatch.setenv("RANK", "2")
    sp = SwapSpace(nvme, 2, buffers=2, buffer_size=16)
    sp.create("a.swp", 1000)
    assert os.path.basename(sp.dir).startswith("zeropp-swap-abc123def456-r2-")
    assert json.loads((world / "scratch.2").read_text()) == {
        "root": str(nvme),
        "prefix": "zeropp-swap-abc123def456-r2-",
    }
    del sp
    gc.collect()
    assert os.listdir(nvme) == []


def test_a_full_disk_during_a_swap_names_the_file(space, monkeypatch):
    import zeropp.runtime.swap as swap

    f = space.create("opt.swp", 4 * 100)

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(swap, "_write_at", full)
    with pytest.raises(SwapError, match=r"opt\.swp.*No space left on device.*nvme_path") as e:
        space.write_from(Segment(f, 0, 100, torch.float32), torch.ones(100))
    assert e.value.errno == errno.ENOSPC and e.value.path == f.path
    monkeypatch.undo()
    space.write_from(Segment(f, 0, 100, torch.float32), torch.ones(100))  # the space is still usable


@pytest.mark.parametrize("kernel", ["single", "fused", "native", "native-exact"])
def test_streamed_adamw_is_the_in_memory_update(tmp_path, kernel):
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    ms = [torch.randn(n, generator=g) for n in (1, 7, 17 * 257)]
    sp = SwapSpace(tmp_path, 0, buffers=3, buffer_size=1000)  # 320 elements of master+m+v per chunk
    try:
        ref = ShardedAdamW([m.clone() for m in ms], cfg, kernel=kernel)
        swapped = SwappedAdamW([m.clone() for m in ms], cfg, space=sp, kernel=kernel)
        for _ in range(3):
            grads = [torch.randn(m.shape, generator=g) for m in ms]
            ref.step(grads)
            swapped.step(grads)
        for name in ShardedAdamW.STATE:
            for i in range(len(ms)):
                assert torch.equal(swapped.state_tensor(name, i), ref.state_tensor(name, i)), (name, i)
        out = torch.empty(17 * 257, dtype=torch.bfloat16)
        swapped.copy_master_to(2, out)
        assert torch.equal(out, ref.masters[2].bfloat16())
        assert swapped.memory_by_tier() == {"device": 0, "host": 0, "disk": 12 * sum(m.numel() for m in ms)}
    finally:
        sp.close()


def test_both_adamw_holders_share_kernel_check_lr_and_numels(tmp_path):
    """ShardedAdamW and SwappedAdamW (and the host tier's HostAdamW) take the kernel check, the
    scheduled rate and the shard sizes from one base: same answers, each error names its class."""
    cfg = OptimizerConfig(lr=1e-2, warmup_steps=2)
    ms = [torch.ones(n) for n in (3, 5)]
    sp = SwapSpace(tmp_path, 0, buffers=2, buffer_size=256)
    try:
        for cls, kw in (
            (ShardedAdamW, {}),
            (SwappedAdamW, {"space": sp}),
            (HostAdamW, {"device": torch.device("cpu")}),
        ):
            with pytest.raises(ValueError, match=f"{cls.__name__} kernel='avx'; use one of"):
                cls([m.clone() for m in ms], cfg, kernel="avx", **kw)
        ref = ShardedAdamW([m.clone() for m in ms], cfg)
        swapped = SwappedAdamW([m.clone() for m in ms], cfg, space=sp)
        for opt in (ref, swapped):
            sizes = opt.numels
            sizes.append(9)  # a copy: the holder's sizes stay
            assert opt.numels == [3, 5]
        rates = []
        for _ in range(3):
            assert ref.lr == swapped.lr
            rates.append(ref.lr)
            grads = [torch.ones(n) for n in (3, 5)]
            ref.step(grads)
            swapped.step(grads)
        assert rates == [cfg.lr_at(0), cfg.lr_at(1), cfg.lr_at(2)] and rates[0] < rates[2]
    finally:
        sp.close()
