"""ZeRO-Offload and ZeRO-Infinity: optimizer state and stage-3 parameter shards off the device.

Optimizer state (``zero.offload_optimizer``):

- ``cpu`` -> :class:`HostAdamW`: fp32 masters and both Adam moments in host memory (pinned when
  the device is CUDA). Each unit's final gradient lands in its host buffer as soon as the engine
  has it (:meth:`HostAdamW.land_grad`: stages 2-3 when the last micro-step's reduce-scatter of
  the unit is added into its shard, during backward; stage 1 and replicated units when the
  reduction after the last micro-step ends), converted to fp32 by the copy (exact) and, on CUDA,
  non-blocking into pinned memory on the current stream, so it overlaps the rest of backward.
  The step then waits once (:meth:`HostAdamW.landed_grads`) and unscales, measures the norm,
  clips and updates on the host buffers: no fp32 gradient copy is made on the device. The engine
  copies the updated masters back into the compute-dtype parameters (non-blocking from pinned
  memory: the copy-back overlaps the all-gather / next forward issue).
- ``nvme`` -> :class:`SwappedAdamW`: master, m and v live in one preallocated swap file per rank
  (``swap.py``); the step streams them through the staging buffers chunk by chunk (read ahead,
  update, write behind), so host memory stays ``swap_buffers * swap_buffer_size`` fp32 elements.

The CPU AdamW kernel (``cpu_adam=``, ``DEFAULT_CPU_KERNEL``), in both tiers: ``native`` by
default, zeropp's one-pass C++ kernel (``zeropp.kernels.cpu_adamw``: AVX-512 / AVX2 loops, torch's
OpenMP threads taking tiles of the shard, built at first use); ``fused`` is torch's fused CPU
``AdamW``. ``python -m experiments.bench_offload`` times both beside torch's single-tensor and
``foreach`` paths and DeepSpeed's ``DeepSpeedCPUAdam`` on the same threads (docs/benchmarks.md).
The rule: ``native`` is the default while paired runs have it at or ahead of ``fused`` at every
shard size from 16K to 64M elements. They do, within the runs' spread, on the loaded 2-core
development machine and on a quiet 2-core Xeon slice: 1.05-2.1x from 16K to 1M, 0.98-1.2x from
2M to 64M, where the step nears the memory bound for every kernel, DeepSpeed's too. The fused
kernel rounds differently from the single-tensor arithmetic the in-memory engine uses (max 1.5e-8
from ``AdamW(foreach=False)`` after 3 steps on unit-scale weights), and ``native`` differs from it
only where the CPU's IEEE square root differs from torch's (MKL's, by an ulp): an offloaded run
with either matches the in-memory run to a tolerance
(tests/{unit,distributed}/test_runtime_offload.py: weights 1e-5 norm-relative, losses 1e-6
relative, after 3 steps). ``cpu_adam="native-exact"`` takes torch's own square root and, like
``"single"`` (torch's single-tensor path, slower), is bit-exact with the in-memory engine; the
tests check each. A native kernel that cannot be built (no C++ compiler) falls back to ``fused``
(``native-exact``: to ``single``) with one warning.

Parameters (``zero.offload_param``, stage 3) -> :class:`ParamStore`: the rank's compute-dtype
shard of each sharded unit, and the stored shard of each frozen unit (compute dtype, or MixZ++'s
quantized wire row; ``frozen.py``), lives on the device (``none``), in host memory (``cpu``) or in
a swap file (``nvme``); :meth:`ParamStore.fetch` gives the device copy the stage-3 gather sends. The
gather of a block is issued ``prefetch_depth`` blocks ahead, so the host-to-device copy (and the
file read) happens that far ahead too.

``memory_by_tier()`` on every holder gives the bytes it keeps on the ``device``, in ``host``
memory and on ``disk``; "device" is the model's device even when that is the CPU.
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

import torch

from .choices import OffloadTier
from .config import OptimizerConfig, ZeroConfig
from .optimizer import KERNELS, TIERS, AdamWShards, ShardedAdamW, adamw_update, tensor_bytes
from .partition import FlatUnit
from .swap import Segment, SwapSpace

DEFAULT_CPU_KERNEL = "native"
"""The CPU AdamW kernel the offloaded optimizer (host and nvme tiers) uses unless told otherwise
(see module docstring for the rule that chose it)."""


def _host_zeros(n: int, pin: bool) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.float32, pin_memory=pin)


class HostAdamW(ShardedAdamW):
    """ZeRO-Offload: state in (pinned) host memory, the step on the CPU with ``kernel``."""

    def __init__(
        self,
        masters: list[torch.Tensor],
        cfg: OptimizerConfig,
        *,
        device: torch.device,
        kernel: str = DEFAULT_CPU_KERNEL,
    ) -> None:
        pin = device.type == "cuda"
        host = []
        for m in masters:
            h = _host_zeros(m.numel(), pin)
            h.copy_(m)
            host.append(h)
        super().__init__(host, cfg, kernel=kernel, tier="host")
        self.device, self.pin = device, pin
        # landing buffers for the fp32 gradient shards (pinned on CUDA): ZeRO-Offload's 4Ψ/N of host
        # gradients. Kept on a CPU device too (one memcpy a step) so that the host holds the same
        # 16Ψ/N whatever the device, as the formulas (memory.expected_by_tier) say.
        self.grad_host = [_host_zeros(m.numel(), pin) for m in host]
        self._landed = [False] * len(host)  # unit i's gradient of this step is in grad_host[i]
        self._events: list = []  # CUDA: one event after each landing copy, waited by landed_grads

    @torch.no_grad()
    def land_grad(self, i: int, grad: torch.Tensor) -> None:
        """Copy unit ``i``'s final reduced gradient (``[S]``, any float dtype, on the device) into
        its host buffer, converting to fp32 (exact for fp16/bf16/fp32). On CUDA the copy is queued
        non-blocking on the current stream, so it is ordered after whatever produced ``grad`` there
        (the add of the reduce-scatter's result) and overlaps the host; an event marks its end."""
        dst = self.grad_host[i]
        if grad.numel() != dst.numel():
            raise ValueError(f"land_grad: unit {i} gradient has {grad.numel()} elements, its buffer {dst.numel()}")
        if grad.is_cuda:
            stream = torch.cuda.current_stream(grad.device)
            grad.record_stream(stream)  # the source is not reused before the copy has read it
            dst.copy_(grad, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
            self._events.append(ev)
        else:
            dst.copy_(grad)
        self._landed[i] = True

    def landed_grads(self) -> list[torch.Tensor]:
        """The fp32 host gradients of this step (``grad_host``, to be unscaled / clipped in place
        and passed to :meth:`step`), once every landing copy is complete. Every unit must have
        landed since the last call (a missing one is an engine bug: its buffer holds an old step)."""
        missing = [i for i, ok in enumerate(self._landed) if not ok]
        if missing:
            raise RuntimeError(f"HostAdamW: the gradients of units {missing} were not landed on the host this step")
        for ev in self._events:  # the single wait before the host math (later events: usually done already)
            ev.synchronize()
        self._events.clear()
        self._landed = [False] * len(self._landed)
        return self.grad_host

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor], on_updated: Callable[[int], None] | None = None) -> None:
        """Update on the host, shard by shard (``on_updated(i)`` after each: the engine copies it
        back meanwhile). ``grads`` is normally :meth:`landed_grads` (used in place); other fp32
        shards (e.g. on the device) are first copied into the landing buffers (one wait)."""
        if any(g is not h for g, h in zip(grads, self.grad_host)):
            for i, g in enumerate(grads):
                if g is not self.grad_host[i]:
                    self.land_grad(i, g)
                else:
                    self._landed[i] = True
            grads = self.landed_grads()
        super().step(grads, on_updated)

    def memory_by_tier(self) -> dict[str, int]:
        out = super().memory_by_tier()
        out["host"] += tensor_bytes(self.grad_host)
        return out


class SwappedAdamW(AdamWShards):
    """ZeRO-Infinity: master, m, v of every shard in this rank's swap file, streamed per step.

    File layout: shard ``i`` occupies ``[off_i, off_i + 12 * S_i)`` bytes, its master, m and v
    back to back. A step visits the shards in order, chunk by chunk through the staging buffers:
    each chunk holds the same ``n`` elements of the three (``n = swap_buffer_size // 3``)."""

    STATE = ShardedAdamW.STATE
    in_memory = False
    """The state lives in the swap file: :meth:`read_range` reads a fresh host copy of one piece,
    :meth:`write_range` writes one (a checkpoint moves it piece by piece, never whole)."""

    def __init__(
        self, masters: list[torch.Tensor], cfg: OptimizerConfig, *, space: SwapSpace, kernel: str = DEFAULT_CPU_KERNEL
    ) -> None:
        super().__init__([m.numel() for m in masters], cfg, kernel)
        self.space = space
        self.file = space.create("optimizer.swp", 12 * sum(self._numels))
        self._offsets, off = [], 0
        for n in self._numels:
            self._offsets.append(off)
            off += 12 * n
        for i, m in enumerate(masters):
            space.write_from(self._seg(i, "masters"), m)
            for name in ("exp_avg", "exp_avg_sq"):
                self._fill_zero(i, name)

    def _seg(self, i: int, name: str) -> Segment:
        n = self._numels[i]
        return Segment(self.file, self._offsets[i] + 4 * n * self.STATE.index(name), n, torch.float32)

    def _fill_zero(self, i: int, name: str) -> None:
        for (v,) in self.space.stream(self.space.chunks_of([self._seg(i, name)]), read=False, write=True):
            v.zero_()

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor], on_updated: Callable[[int], None] | None = None) -> None:
        """Stream every shard's (master, m, v) through the buffers and update each chunk; then
        ``on_updated(i)`` for every shard (after the last write-back: the caller reads the file)."""
        self.check_valid()
        lr = self.lr
        self.step_count += 1
        chunks, where = [], []
        for i in range(len(self._numels)):
            for c in self.space.chunks_of([self._seg(i, name) for name in self.STATE]):
                lo = (c[0].offset - self._seg(i, "masters").offset) // 4
                chunks.append(c)
                where.append((i, lo, lo + c[0].numel))
        # the stream drives the loop (zip would stop before resuming it to write the last chunk back)
        for k, (p, m, v) in enumerate(self.space.stream(chunks, read=True, write=True)):
            i, lo, hi = where[k]
            g = grads[i][lo:hi]
            if g.device.type != "cpu":
                g = g.to("cpu")
            adamw_update([p], [g], [m], [v], step=self.step_count, lr=lr, cfg=self.cfg, kernel=self.kernel)
        if on_updated is not None:
            for i in range(len(self._numels)):
                on_updated(i)

    def master_chunks(self, i: int) -> Iterator[tuple[int, int, torch.Tensor]]:
        self.check_valid()
        lo = 0
        for (v,) in self.space.stream(self.space.chunks_of([self._seg(i, "masters")])):
            yield lo, lo + v.numel(), v
            lo += v.numel()

    @torch.no_grad()
    def copy_master_to(self, i: int, dst: torch.Tensor) -> None:
        for lo, hi, chunk in self.master_chunks(i):
            dst[lo:hi].copy_(chunk)  # blocking: the staging buffer is reused right after

    def state_tensor(self, name: str, i: int) -> torch.Tensor:
        """A fresh host copy of state ``name`` of shard ``i``."""
        return self.read_range(name, i, 0, self._numels[i])

    def read_range(self, name: str, i: int, lo: int, hi: int) -> torch.Tensor:
        """A fresh host copy of elements ``[lo, hi)`` of state ``name`` of shard ``i``, read through
        the staging buffers: not straight into it (``SwapSpace.read_into``'s direct read hands its
        memory to numpy, which makes its storage unresizable), so that a checkpoint save can free
        it (``checkpoint_stream.StreamingSavePlanner``) while DCP still holds a reference."""
        out, at = torch.empty(hi - lo, dtype=torch.float32), 0
        for (v,) in self.space.stream(self.space.chunks_of([self._piece(name, i, lo, hi - lo)])):
            out[at : at + v.numel()].copy_(v)
            at += v.numel()
        return out

    @torch.no_grad()
    def write_range(self, name: str, i: int, lo: int, src: torch.Tensor) -> None:
        """Write ``src`` (1-D, any device and float dtype) into elements ``[lo, lo + len(src))`` of
        state ``name`` of shard ``i`` (straight from a host fp32 tensor, else staged)."""
        self.space.write_from(self._piece(name, i, lo, src.numel()), src)

    def _piece(self, name: str, i: int, lo: int, n: int) -> Segment:
        seg = self._seg(i, name)
        if lo < 0 or n < 0 or lo + n > seg.numel:
            raise ValueError(
                f"elements [{lo}, {lo + n}) are outside state {name!r} of shard {i} ({seg.numel} elements)"
            )
        return Segment(seg.file, seg.offset + 4 * lo, n, torch.float32)

    def nbytes(self) -> int:
        return sum(self.memory_by_tier().values())

    def memory_by_tier(self) -> dict[str, int]:
        """The swap file on disk; the staging buffers are the swap space's (counted once, by the engine)."""
        out = dict.fromkeys(TIERS, 0)
        out["disk"] = self.file.nbytes
        return out

    def close(self) -> None:
        """The files go with the swap space (closed by its owner)."""


def make_optimizer(
    masters: list[torch.Tensor],
    opt_cfg: OptimizerConfig,
    cfg: ZeroConfig,
    *,
    device: torch.device,
    space: SwapSpace | None,
    masters_are_params: bool,
    cpu_adam: str | None = None,
) -> ShardedAdamW | SwappedAdamW:
    """The optimizer-state holder for ``cfg.offload_optimizer`` (masters: fp32 shards on ``device``).
    ``cpu_adam``: the AdamW kernel; None: :data:`DEFAULT_CPU_KERNEL` for the offload tiers, ``exact``
    (torch's single-tensor bits, ``optimizer.py``) in memory. A native kernel for state on a GPU is
    refused here, before any step."""
    if cpu_adam is not None and cpu_adam not in KERNELS:
        raise ValueError(f"cpu_adam={cpu_adam!r} is not a CPU AdamW kernel; use one of {KERNELS}")
    if cfg.offload_optimizer == "cpu":
        return HostAdamW(masters, opt_cfg, device=device, kernel=cpu_adam or DEFAULT_CPU_KERNEL)
    if cfg.offload_optimizer == "nvme":
        assert space is not None
        return SwappedAdamW(masters, opt_cfg, space=space, kernel=cpu_adam or DEFAULT_CPU_KERNEL)
    if cpu_adam is not None and cpu_adam.startswith("native") and device.type != "cpu":
        raise ValueError(
            f"cpu_adam={cpu_adam!r} runs on CPU tensors, but without offload_optimizer the optimizer state is on "
            f"{device}; drop cpu_adam (torch's AdamW runs there), or set offload_optimizer='cpu' or 'nvme'"
        )
    return ShardedAdamW(masters, opt_cfg, kernel=cpu_adam or "exact", masters_are_params=masters_are_params)


class ParamStore:
    """Stage 3: where each sharded unit's compute-dtype parameter shard ``[S]`` lives between
    gathers (``tier``: ``none`` = ``u.param_shard`` on the device, ``cpu`` = ``u.param_shard`` in
    (pinned) host memory, ``nvme`` = a region of this rank's ``params.swp``, ``u.param_shard`` None).
    Frozen units (``frozen.py``) are stored through :meth:`keep` (their shard as ``frozen`` stores it:
    ``u.extra["stored"]`` gives its size and dtype), after the trainable regions of the file."""

    ALIGN = 64
    """Byte alignment of each frozen unit's region of the swap file."""

    def __init__(
        self,
        tier: str,
        units: Sequence[FlatUnit],
        *,
        dtype: torch.dtype,
        device: torch.device,
        space: SwapSpace | None = None,
    ) -> None:
        if tier not in OffloadTier.values():
            raise ValueError(f"ParamStore tier={tier!r}; use one of {', '.join(OffloadTier.values())}")
        self.tier, self.dtype, self.device, self.space = tier, dtype, device, space
        self.units = [u for u in units if u.kind == "sharded"]
        self.frozen = [u for u in units if u.kind == "frozen"]
        self.pin = device.type == "cuda"
        self._segs: dict[int, Segment] = {}
        self._host: dict[int, torch.Tensor] = {}  # frozen unit -> its stored shard in host memory (cpu)
        if tier != "none":
            for u in self.units + self.frozen:
                u.extra["param_store"] = self  # gathers.UnitGathers.gather reads the shard through fetch()
        if tier == "nvme":
            assert space is not None
            regions: list[tuple[FlatUnit, int, torch.dtype, int]] = []  # unit, numel, dtype, byte offset
            off = 0
            for u in self.units:
                regions.append((u, u.shard_numel, dtype, off))
                off += u.shard_numel * dtype.itemsize
            for u in self.frozen:  # after the trainable shards (whose layout stays packed), aligned
                numel, dt = u.extra["stored"]
                off = -(-off // self.ALIGN) * self.ALIGN
                regions.append((u, numel, dt, off))
                off += numel * dt.itemsize
            self.file = space.create("params.swp", off)
            self._segs = {id(u): Segment(self.file, at, numel, dt) for u, numel, dt, at in regions}

    def put(self, u: FlatUnit, shard: torch.Tensor) -> None:
        """Store ``shard`` (``[S]``, any dtype: cast to the compute dtype) as ``u``'s parameters.
        With tier ``none`` and a shard already of the compute dtype on the device, it is kept as is."""
        if self.tier == "none":
            same = shard.dtype == self.dtype and shard.device == self.device
            u.param_shard = shard if same else shard.to(device=self.device, dtype=self.dtype)
        elif self.tier == "cpu":
            h = torch.empty(u.shard_numel, dtype=self.dtype, pin_memory=self.pin)
            h.copy_(shard)
            u.param_shard = h
        else:
            u.param_shard = None
            self._swap().write_from(self._segs[id(u)], shard)

    def _swap(self) -> SwapSpace:
        """The swap space of the nvme tier (the constructor requires one there)."""
        assert self.space is not None, "only the nvme tier stores parameters in a swap space"
        return self.space

    def keep(self, u: FlatUnit, t: torch.Tensor) -> torch.Tensor | None:
        """Store frozen unit ``u``'s shard ``t`` (as ``frozen.py`` stores it: compute dtype or wire
        row) on this tier; returns the host copy the unit then holds (cpu), or None (nvme: written
        to its region of the swap file)."""
        if self.tier == "cpu":
            h = torch.empty(t.numel(), dtype=t.dtype, pin_memory=self.pin)
            h.copy_(t)
            self._host[id(u)] = h
            return h
        if self.tier == "nvme":
            self._swap().write_from(self._segs[id(u)], t)
            return None
        return t

    def fetch(self, u: FlatUnit) -> torch.Tensor:
        """``u``'s shard on the device: ``[S]`` compute dtype for a sharded unit, a frozen unit's
        stored shard as it is; the all-gather's input."""
        if self.tier == "none":
            assert u.param_shard is not None, "the none tier keeps the shard on the unit"
            return u.param_shard
        if self.tier == "cpu":  # the same tensor on a CPU device
            h = self._host.get(id(u), u.param_shard)
            assert h is not None, "the cpu tier keeps the shard on the unit or in its host copies"
            return h.to(self.device, non_blocking=True)
        # nvme: staged through pinned buffers with asynchronous copies that overlap compute (swap.read_to)
        return self._swap().read_to(self._segs[id(u)], self.device)

    @torch.no_grad()
    def update(self, u: FlatUnit, optim: ShardedAdamW | SwappedAdamW, i: int) -> None:
        """Refresh ``u``'s shard from optimizer master ``i`` (after a step or a load)."""
        if self.tier != "nvme":
            assert u.param_shard is not None, "the none and cpu tiers keep the shard on the unit"
            optim.copy_master_to(i, u.param_shard)
            return
        seg, item = self._segs[id(u)], self.dtype.itemsize
        for lo, hi, chunk in optim.master_chunks(i):
            piece = chunk.to(self.dtype, copy=True)  # at most one staging buffer's worth
            # written directly: the staging buffers are busy streaming the masters
            self._swap().write_direct(Segment(seg.file, seg.offset + lo * item, hi - lo, self.dtype), piece)

    def memory_by_tier(self) -> dict[str, int]:
        """Bytes of parameter shards per tier, frozen units' included (staging buffers are the swap space's)."""
        out = dict.fromkeys(TIERS, 0)
        if self.tier == "nvme":
            out["disk"] = self.file.nbytes
        else:
            out["device" if self.tier == "none" else "host"] = tensor_bytes(
                [u.param_shard for u in self.units] + list(self._host.values())
            )
        return out
