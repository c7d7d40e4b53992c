"""Sharded AdamW on fp32 master shards.

Each rank updates only the slice of every flat unit it owns (the whole unit for replicated
units). The default arithmetic (``kernel="exact"``) is the single-tensor path of
``torch.optim.AdamW`` operation for operation, so an update of a flat shard is bit-identical to
``AdamW(foreach=False)`` applied to the same elements one parameter at a time; that is what lets
the tests demand exact parity. ``exact`` runs it by the fastest path that gives those bits here:
on CPU tensors the native kernel with torch's own square root (``native-exact``, 3-8x faster than
torch's six passes over memory, which at stage 0 cost several percent of a CPU rank's step), once a
probe in this process has shown it gives ``single``'s bits; else ``single``, torch's own ops (on a
GPU, or where the native kernel cannot be built). ``kernel="foreach"`` and ``kernel="fused"`` run torch's own
multi-tensor and fused AdamW kernels (``torch.optim.adamw.adamw``) on the same state; the fused
CPU kernel rounds differently (about 1 ulp of the update, 1e-8 absolute on unit-scale weights
after a step). ``kernel="native"`` and ``"native-exact"`` run ``zeropp.kernels.cpu_adamw``, the
one-pass CPU kernel the CPU offload uses by default (``cpu_adam=``, see ``offload.py``): ``native-exact`` is bit-identical
to ``single``; ``native`` uses the IEEE square root where torch's differs by an ulp (m and v
identical, weights within about an ulp per step). A native kernel that cannot be built falls
back to ``fused`` / ``single`` with one warning.

Every optimizer-state holder (this class, and ``offload.HostAdamW`` / ``offload.SwappedAdamW``)
offers the same small interface the engine and the checkpoint use: ``step(grads, on_updated)``, ``lr``,
``step_count``, ``numels``, ``state_tensor(name, i)``, ``master_chunks(i)``, ``copy_master_to(i, dst)``,
``nbytes()`` and ``memory_by_tier()``; and, for checkpoints, ``in_memory``, ``read_range`` /
``write_range`` (one piece of one state: a checkpoint moves the state piece by piece, in its own
tier), ``loaded(step)`` and ``invalidate(reason)`` (see :meth:`ShardedAdamW.invalidate`).
"""

from __future__ import annotations

import warnings
from typing import Callable, Iterator, Sequence

import torch

from zeropp.kernels import cpu_adamw

from .choices import MemoryTier
from .config import OptimizerConfig

KERNELS = ("exact", "single", "foreach", "fused", "native", "native-exact")
"""The AdamW kernels: ``exact`` (torch's single-tensor bits by the fastest path here: see the module
docstring), torch's single-tensor, ``foreach`` and fused paths, and the native CPU kernel
(``zeropp.kernels.cpu_adamw``; ``native-exact`` takes torch's own square root and is bit-exact
with ``single``, ``native`` the CPU's IEEE one)."""
TIERS = MemoryTier.values()

_FALLBACK = {"native": "fused", "native-exact": "single"}
"""What a native kernel falls back to when it cannot be built or loaded (the exact one to the exact path)."""
_warned_fallback = False


def _native_or_fallback(kernel: str, tensors: Sequence[torch.Tensor]) -> str:
    """``kernel`` if it is a native one that can run here, else the kernel to run instead: a
    native kernel on non-CPU tensors is an error; one that failed to build falls back (one warning);
    ``exact`` is ``native-exact`` where the kernel takes every tensor (``tensors``: all of the
    update's) and gives torch's bits here, else ``single`` (no warning: the same bits either way)."""
    global _warned_fallback
    if kernel == "exact":
        return "native-exact" if cpu_adamw.takes(tensors) and cpu_adamw.reproduces_reference() else "single"
    if kernel not in _FALLBACK:
        return kernel
    off_cpu = [t.device for t in tensors if t.device.type != "cpu"]
    if off_cpu:
        raise ValueError(f"AdamW kernel={kernel!r} runs on CPU tensors only, not on {off_cpu[0]}; use 'single' there")
    if cpu_adamw.available():
        return kernel
    if not _warned_fallback:
        _warned_fallback = True
        warnings.warn(
            f"zeropp: the native CPU AdamW kernel is unavailable ({cpu_adamw.FAILED}); running torch's "
            f"{_FALLBACK[kernel]!r} AdamW instead (install a C++ compiler, or set cpu_adam='fused' to silence this)",
            RuntimeWarning,
            stacklevel=3,
        )
    return _FALLBACK[kernel]


def adamw_update(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    step: int,
    lr: float,
    cfg: OptimizerConfig,
    kernel: str = "exact",
) -> None:
    """One AdamW update of ``params`` in place (all fp32, same shapes pairwise); ``step`` is the
    1-based count including this update. Element-wise: with ``exact``, ``single``, ``foreach`` and the native
    kernels, updating a tensor in chunks gives the same bits as updating it whole; the ``fused`` CPU
    kernel rounds its SIMD body and its scalar tail differently, so it does so only for chunks that
    are whole SIMD blocks (the nvme tier cuts chunks at multiples of ``swap.ALIGN`` elements for that)."""
    if kernel not in KERNELS:
        raise ValueError(f"AdamW kernel={kernel!r}; use one of {KERNELS}")
    (beta1, beta2), eps, wd = cfg.betas, cfg.eps, cfg.weight_decay
    kernel = _native_or_fallback(kernel, [*params, *grads, *exp_avgs, *exp_avg_sqs] if kernel == "exact" else params)
    hp = cpu_adamw.AdamWStep(step=step, lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=wd)
    if kernel == "single":
        cpu_adamw.adamw_reference(params, grads, exp_avgs, exp_avg_sqs, hp)
        return
    if kernel in _FALLBACK:
        cpu_adamw.adamw(params, grads, exp_avgs, exp_avg_sqs, hp, exact=kernel == "native-exact")
        return
    from torch.optim.adamw import adamw

    # torch's multi-tensor / fused paths increment the step tensors themselves before using them
    steps = [torch.tensor(float(step - 1)) for _ in params]
    adamw(
        list(params),
        list(grads),
        list(exp_avgs),
        list(exp_avg_sqs),
        [],
        steps,
        foreach=kernel == "foreach",
        fused=kernel == "fused",
        amsgrad=False,
        beta1=beta1,
        beta2=beta2,
        lr=lr,
        weight_decay=wd,
        eps=eps,
        maximize=False,
    )


def tensor_bytes(ts: Sequence[torch.Tensor | None]) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


class StateGuard:
    """The mark a checkpoint load leaves on an optimizer-state holder when it failed after it had
    replaced part of the state (a checkpoint loads in place, piece by piece, so that its transient
    memory is one piece, not a second copy of the state: ``checkpoint.py``)."""

    invalid: str | None = None
    """Why the state may not be used, or None."""
    step_count: int

    def invalidate(self, reason: str) -> None:
        """Mark the state unusable: a checkpoint load failed after it had replaced part of it. Until
        :meth:`loaded`, :meth:`step` and :meth:`master_chunks` (so the parameter refresh and the
        consolidated export) raise ``RuntimeError(reason)``: a mix of two states never trains."""
        self.invalid = reason

    def loaded(self, step: int) -> None:
        """A checkpoint load wrote every state: set the step count and clear :meth:`invalidate`'s mark."""
        self.step_count = int(step)
        self.invalid = None

    def check_valid(self) -> None:
        """Raise ``RuntimeError`` if :meth:`invalidate` marked the state unusable."""
        if self.invalid is not None:
            raise RuntimeError(self.invalid)


class AdamWShards(StateGuard):
    """What every AdamW state holder shares, wherever its tensors live: the config, the update
    kernel, the step count and each shard's element count, and from them the learning rate."""

    def __init__(self, numels: Sequence[int], cfg: OptimizerConfig, kernel: str) -> None:
        if kernel not in KERNELS:
            raise ValueError(f"{type(self).__name__} kernel={kernel!r}; use one of {KERNELS}")
        self.cfg, self.kernel = cfg, kernel
        self._numels = list(numels)
        self.step_count = 0

    @property
    def lr(self) -> float:
        """The learning rate the next ``step`` uses."""
        return self.cfg.lr_at(self.step_count)

    @property
    def numels(self) -> list[int]:
        """Elements of each shard (padded ``[S]``, or the padded unit if replicated)."""
        return list(self._numels)


class ShardedAdamW(AdamWShards):
    """fp32 master weights, first and second moments, for a list of flat shards, all in one tier.

    ``masters_are_params=True`` says the master tensors are the compute parameters themselves
    (fp32 compute, no offload: ZeRO's "no redundant copy"); they are then not counted as
    optimizer bytes, because the parameters already count them. ``tier`` names where the tensors
    live for :meth:`memory_by_tier` (``device`` here; ``host`` for the CPU offload)."""

    STATE = ("masters", "exp_avg", "exp_avg_sq")
    """Names of the per-shard fp32 state lists (what a checkpoint stores per unit)."""
    in_memory = True
    """The state lives in tensors (device or host memory): :meth:`read_range` is a view of the live
    state, so a checkpoint saves from it and loads into it in place, with no copy."""

    def __init__(
        self,
        masters: list[torch.Tensor],
        cfg: OptimizerConfig,
        *,
        kernel: str = "exact",
        masters_are_params: bool = False,
        tier: str = "device",
    ) -> None:
        for m in masters:
            if m.dtype != torch.float32:
                raise TypeError(f"master shards must be fp32, got {m.dtype}")
        super().__init__([m.numel() for m in masters], cfg, kernel)
        if tier not in TIERS:
            raise ValueError(f"ShardedAdamW tier={tier!r}; use one of {TIERS}")
        self.tier = tier
        self.masters_are_params = masters_are_params
        self.masters = masters  # each [S] fp32
        self.exp_avg = [torch.zeros_like(m) for m in masters]
        self.exp_avg_sq = [torch.zeros_like(m) for m in masters]

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor], on_updated: Callable[[int], None] | None = None) -> None:
        """One AdamW update; ``grads[i]`` is the fp32 gradient of ``masters[i]`` (same shape). The
        rate is the schedule's ``cfg.lr_at(steps taken so far)``. ``on_updated(i)`` is called as
        soon as shard ``i`` is updated (shard by shard: the same bits as one call over all, the
        update being element-wise), so the caller can copy it back while the next one updates."""
        self.check_valid()
        lr = self.lr
        self.step_count += 1
        for i, (p, g, m, v) in enumerate(zip(self.masters, grads, self.exp_avg, self.exp_avg_sq)):
            adamw_update([p], [g], [m], [v], step=self.step_count, lr=lr, cfg=self.cfg, kernel=self.kernel)
            if on_updated is not None:
                on_updated(i)

    def state_tensor(self, name: str, i: int) -> torch.Tensor:
        """State ``name`` (one of :data:`STATE`) of shard ``i``, readable (a checkpoint saves it)."""
        return getattr(self, name)[i]

    def master_chunks(self, i: int) -> Iterator[tuple[int, int, torch.Tensor]]:
        """``(lo, hi, master[lo:hi])`` pieces covering master ``i`` (one piece when in memory);
        a piece is valid until the next one is requested."""
        self.check_valid()
        yield 0, self.masters[i].numel(), self.masters[i]

    @torch.no_grad()
    def copy_master_to(self, i: int, dst: torch.Tensor) -> None:
        """Copy (cast) master ``i`` into ``dst`` (same length, any dtype and device); nothing to do
        when ``dst`` is the master itself."""
        for lo, hi, chunk in self.master_chunks(i):
            d = dst[lo:hi]
            if d.data_ptr() != chunk.data_ptr() or d.device != chunk.device:
                # host -> CUDA from pinned memory is asynchronous (ordered before the gather on the
                # stream; the host side is not written again before the next step's loss sync)
                d.copy_(chunk, non_blocking=d.is_cuda)

    def nbytes(self) -> int:
        """Bytes of optimizer state held by this rank, all tiers (masters that are the parameters
        themselves are counted as parameters, not here)."""
        return sum(self.memory_by_tier().values())

    def memory_by_tier(self) -> dict[str, int]:
        """Bytes of master weights (unless they are the parameters) and both moments, per tier."""
        out = dict.fromkeys(TIERS, 0)
        out[self.tier] = tensor_bytes(self.exp_avg) + tensor_bytes(self.exp_avg_sq)
        if not self.masters_are_params:
            out[self.tier] += tensor_bytes(self.masters)
        return out

    def read_range(self, name: str, i: int, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of state ``name`` of shard ``i``: a view of the live tensor."""
        return getattr(self, name)[i][lo:hi]

    @torch.no_grad()
    def write_range(self, name: str, i: int, lo: int, src: torch.Tensor) -> None:
        """Copy ``src`` (1-D, any device) into elements ``[lo, lo + len(src))`` of state ``name`` of shard ``i``."""
        dst = getattr(self, name)[i][lo : lo + src.numel()]
        if dst.data_ptr() != src.data_ptr() or dst.device != src.device:
            dst.copy_(src)

    def close(self) -> None:
        """Release resources (nothing for in-memory state)."""
