"""The single-GPU cuda tests' own logic, on CPU.

A GPU is lent rarely and briefly, so a cuda test that fails for a reason in its own bookkeeping
(a name, a rank's result, an expected figure) wastes it. Here the logic of the single-GPU runtime
tests in ``tests/gpu`` runs on CPU with what only CUDA has replaced: ``.cuda()`` is the identity and
the NCCL setup is skipped (as in ``test_runtime_gpu_worlds.py``); the engine's side streams are the
recording fake of ``tests/fake_streams.py``; ``set_sync_debug_mode("warn")`` warns, from the
caller's line, at every read of a tensor's values (the reads a GPU synchronizes on; its blocking
host-to-device copies have no CPU counterpart); the caching allocator's figures come from a small
counting fake; a ``torch.device("cuda", i)`` the test makes itself is the CPU.

Left to the GPU: the stream timing test (its bounds are on real stall times), the nvme fetch past
a sleeping compute stream (pinned memory and copy streams), the Triton, bandwidth and NCCL rows of
the doctor and its whole command, the runner's jobs on CUDA.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from types import ModuleType, SimpleNamespace
from typing import Any, Iterator

import pytest
import torch

from tests.distributed.test_runtime_gpu_worlds import _on_cpu
from tests.worlds import run_world


class _CpuTorch(ModuleType):
    """``torch`` as a cuda test module sees it: the same, but every ``torch.device(...)`` is the CPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def device(*args: Any, **kwargs: Any) -> torch.device:
        return torch.device("cpu")


def _cpu_devices(module: ModuleType) -> ModuleType:
    """``module`` with its ``torch`` replaced by :class:`_CpuTorch`."""
    module.torch = _CpuTorch("torch")  # type: ignore[attr-defined]
    return module


# ------------------------------------------------------------------ test_runtime_overlap_cuda
def _overlap_module() -> ModuleType:
    m = _on_cpu("tests.gpu.test_runtime_overlap_cuda")
    setattr(m, "_nccl", lambda *a, **k: None)  # noqa: B010
    return m


def _streams_rank(rank: int, world: int, store: str) -> dict:
    """``_streams_vs_none`` with every engine's streams the recording fake (so ``enabled``)."""
    import zeropp.runtime.collectives as collectives
    from tests.fake_streams import FakeAPI
    from zeropp.runtime.streams import CommStreams

    m = _overlap_module()
    collectives.CommStreams = lambda device, **k: CommStreams(device, api=FakeAPI())  # type: ignore[misc]
    return m._streams_vs_none(rank, world, store)


def _ddp_rank(rank: int, world: int, store: str) -> bool:
    """``_ddp`` with DDP's ``device_ids`` dropped (a CPU module refuses them)."""
    import torch.nn.parallel as parallel

    m = _overlap_module()
    real = parallel.DistributedDataParallel
    parallel.DistributedDataParallel = lambda module, *a, device_ids=None, **k: real(module, *a, **k)  # type: ignore[misc]
    return m._ddp(rank, world, store)


def _qgz_rank(rank: int, world: int, store: str) -> bool:
    """``_qgz_async`` with its per-rank CUDA devices the CPU."""
    return _cpu_devices(_overlap_module())._qgz_async(rank, world, store)


def test_the_overlap_tests_compare_what_they_mean_to(tmp_path) -> None:
    """Streams against none (each config equal), the hooked DDP against stock DDP, outstanding qgZ
    on 2 emulated nodes of 2 against synchronous: every comparison holds on CPU ranks."""
    (streams,) = run_world(_streams_rank, 1, str(tmp_path / "s"), timeout=120)
    assert len(streams) == 3 and all(streams.values()), streams
    assert run_world(_ddp_rank, 1, str(tmp_path / "d"), timeout=120) == [True]
    assert run_world(_qgz_rank, 4, str(tmp_path / "q"), timeout=120) == [True] * 4


# ------------------------------------------------------------------ test_runtime_host_reads
def _syncs_rank(rank: int, world: int, store: str) -> dict[int, list[tuple[str, int]]]:
    """``_cuda_syncs`` at stages 0 and 3, each host read warning as a synchronizing CUDA call does."""
    from tests.host_reads import READS

    m = _on_cpu("tests.gpu.test_runtime_host_reads")
    saved: dict[str, Any] = {}

    def warning(real: Any) -> Any:
        def read(self: torch.Tensor, *a: Any, **k: Any) -> Any:
            warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=2)
            return real(self, *a, **k)

        return read

    def set_sync_debug_mode(mode: str) -> None:
        if mode == "warn":
            for name in READS:
                saved[name] = torch.Tensor.__dict__.get(name)
                setattr(torch.Tensor, name, warning(getattr(torch.Tensor, name)))
            return
        for name, original in saved.items():
            if original is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)
        saved.clear()

    torch.cuda.set_sync_debug_mode = set_sync_debug_mode  # type: ignore[assignment]
    return {stage: m._cuda_syncs(rank, world, f"{store}{stage}", stage) for stage in (0, 3)}


def test_the_sync_count_test_finds_the_one_read_of_a_step(tmp_path) -> None:
    """The reads the GPU test keeps (library files, not streams.py) are the one in update.py."""
    (syncs,) = run_world(_syncs_rank, 1, str(tmp_path / "store"), timeout=120)
    for stage, found in syncs.items():
        assert len(found) == 1 and found[0][0].endswith("update.py"), (stage, found)


# ------------------------------------------------------------------ test_runtime_memory_phases
class _Allocator:
    """Counts the bytes of the tensors made with ``device="cuda"`` (made on the CPU) while alive,
    with a resettable peak, and answers the ``torch.cuda`` memory calls from the count."""

    def __init__(self) -> None:
        self.current = self.peak = 0

    def add(self, t: torch.Tensor) -> torch.Tensor:
        n = t.numel() * t.element_size()
        self.current += n
        self.peak = max(self.peak, self.current)
        weakref.finalize(t, self.free, n)
        return t

    def free(self, n: int) -> None:
        self.current -= n

    def nested(self, *a: Any) -> dict:
        return {
            "allocated_bytes": {"all": {"current": self.current, "peak": self.peak}},
            "reserved_bytes": {"all": {"current": self.peak}},
        }

    def reset(self, *a: Any) -> None:
        self.peak = self.current


@contextlib.contextmanager
def _fake_allocator(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Allocator]:
    alloc = _Allocator()
    real_empty = torch.empty

    def empty(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        t = real_empty(*args, **kwargs)
        return alloc.add(t) if device is not None and torch.device(device).type == "cuda" else t

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", alloc.nested)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", alloc.reset)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: alloc.current)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: alloc.peak)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: alloc.peak)
    held = alloc.add(real_empty(3 << 20, dtype=torch.uint8))  # what earlier tests still hold
    yield alloc
    del held


def test_the_allocator_peak_test_expects_what_an_allocator_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA peak test's figures, against a counting allocator that already holds 3 MiB."""
    import tests.gpu.test_runtime_memory_phases as m

    with _fake_allocator(monkeypatch) as alloc:
        held = alloc.current
        m.test_cuda_peak_comes_from_the_allocator_and_resets_per_phase()
        assert alloc.current == held


# ------------------------------------------------------------------ test_runtime_zero_r
def test_the_pinned_offload_test_holds_on_the_host_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The offload-to-host exactness test with its ``cuda`` device the CPU (unpinned host copies)."""
    import tests.gpu.test_runtime_zero_r as m

    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    monkeypatch.setattr(torch.nn.Module, "cuda", lambda self, *a, **k: self)
    monkeypatch.setattr(m, "torch", _CpuTorch("torch"))
    m.test_offload_to_pinned_host_on_cuda_is_exact()


# ------------------------------------------------------------------ test_doctor_cuda
def test_the_doctor_rows_test_reads_what_a_one_gpu_torch_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cuda and gpus rows against a torch that reports one H100 (a GPU never has peer access
    to itself, so the diagonal the test demands is the doctor's own)."""
    import tests.gpu.test_doctor_cuda as m

    props = SimpleNamespace(
        name="NVIDIA H100 80GB HBM3", total_memory=80 << 30, major=9, minor=0, multi_processor_count=132
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: props.name)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda i, j: False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    m.test_the_cuda_and_gpu_rows_report_what_torch_reports()
