"""A native CPU AdamW step: ``cpu_adamw.cpp``, one pass over fp32 flat buffers, on torch's own
OpenMP threads, built with the system C++ compiler at first use and called through ``ctypes``
(what ZeRO-Offload's host optimizer and the nvme tier's chunk update run, ``zeropp.runtime.offload``,
and, where :func:`reproduces_reference` holds, the in-memory optimizer of CPU ranks).

Why hand-written: torch's single-tensor AdamW makes six passes over memory (one per op), and its
fused CPU kernel, one pass, trails DeepSpeed's ``DeepSpeedCPUAdam`` at 16M elements on two threads
(``python -m experiments.bench_offload`` prints the three side by side). What the kernel does
about speed (the .cpp says how):

- explicit AVX-512 (else AVX2, else a loop gcc vectorises) code that loads 8 vectors of each array
  in a row: past the L3 the update is bound by memory, and runs of whole lines per array use it
  better than one line of each array in turn;
- the range cut into tiles of 64K elements that the threads take from a shared counter, so a
  thread the OS holds back (a loaded machine) does fewer tiles instead of holding up the step; a
  shard of fewer than 4 such tiles per thread is cut into smaller ones (whole 1K blocks, at least
  16K elements) so that each thread still takes about 4: with 64K tiles, a 64K shard ran on one
  thread and a 96K one on two unequal halves, and torch's fused kernel, which splits any shard
  evenly across the threads, was up to 1.6x faster there;
- the threads are torch's OpenMP team (``-fopenmp`` links ``libgomp.so.1`` by name, the copy
  torch has already loaded): the step runs on the threads torch's ops just used, not on threads
  of its own competing with them. Where torch is not built on libgomp, the kernel brings its
  own OpenMP runtime, which works, with that competition.

With ``exact=True`` each tile goes in blocks that stay in L1 across the moments loop, the call
that takes their square roots and the weight loop. The build, cache and load are
``cpu_native.py``'s (same compiler, cache directory and ``build_cache`` checks, a library of its
own, ``za_<hash>.so``; the key holds the CPU's feature flags, which ``-march=native`` compiles
for), with two more flags: ``-fno-math-errno`` (lets ``sqrtf`` vectorise; it only stops setting
``errno``) and ``-fopenmp``.

Arithmetic: that of ``torch.optim.AdamW(foreach=False)`` (:func:`adamw_reference`), operation by
operation in torch's order (the .cpp lists them), so with ``exact=True`` the result is bit for bit
torch's, checked by ``tests/unit/test_kernels_adamw.py``. One operation depends on how torch was
built: its fp32 ``sqrt`` is MKL's ``vmsSqrt`` where torch has MKL, and that is not always the
correctly rounded root. ``exact=True`` takes the square roots from that same routine (looked up in
torch's own library, and used only if it reproduces ``torch.sqrt`` on a probe); ``exact=False``
uses the CPU's IEEE square root, which is faster: m and v are still bit-exact, and a weight differs
from torch's by at most about one ulp per step (1 ulp of the root moves the update by 1 ulp);
it is bit for bit :func:`adamw_reference` with ``ieee_sqrt=True`` on every code path.
Where no such routine is found (torch without MKL, whose ``sqrt`` is the IEEE one),
``exact=True`` uses the IEEE root as well.

Scalars are rounded to fp32 as torch rounds a Python scalar operand of an fp32 tensor op; the
bias corrections and step size are computed in Python floats, as torch's single-tensor path does.
If the build or the load fails, :func:`library` returns None and says why in :data:`FAILED`; the
runtime then runs torch's kernel instead (``zeropp.runtime.optimizer``), with one warning where the
kernel was asked for by name (``native``, ``native-exact``) and silently for ``exact``, whose bits
are the same either way.
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys
import threading
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import torch

from . import build_cache, cpu_native

SOURCE = Path(__file__).with_name("cpu_adamw.cpp")
FLAGS = [*cpu_native.FLAGS, "-fno-math-errno", "-fopenmp"]
"""``cpu_native.FLAGS`` (``-march=native``, no FMA contraction, no value-changing fast-math flag)
plus the two above."""

FAILED: str | None = None
"""Why the kernel is unavailable in this process (None while it works or is unbuilt)."""

_LIB: ctypes.CDLL | None = None
_LOCK = threading.Lock()

FORKED = False
"""Whether this process was forked from one that had run the kernel on several threads. libgomp
keeps no thread team across a fork: in such a child the next parallel region waits forever for
threads that were not copied (torch's own parallel ops hang there too, when the parent ran them).
So that child runs the kernel on its calling thread alone (same bits, slower). A child of a
process that never ran it in parallel (a forkserver that only imported it) keeps its threads."""

_RAN_PARALLEL = False
"""Whether this process has asked the kernel for more than one thread (its OpenMP team may exist)."""


def _forked() -> None:
    global FORKED
    FORKED = _RAN_PARALLEL


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)

_VML_MODE = 0x2 | 0x140000 | 0x100
"""The mode ATen passes to MKL's vector math (``VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE``)."""


def _load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    p, i, f, c = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    lib.za_adamw.argtypes = [p, p, p, p, i, c, f, f, c, f, f, f, f, f, p, i, c]
    lib.za_adamw.restype = c
    return lib


def load() -> tuple[ctypes.CDLL, Path]:
    """Load the kernel (from the cache, else built) and return it with its file. Raises what went wrong."""
    name, build = cpu_native.named_build(SOURCE, FLAGS, "za")
    return build_cache.load_library(cpu_native.cache_dir(), name, build, _load)


def library() -> ctypes.CDLL | None:
    """The loaded kernel (built at the first call), or None when unavailable (see :data:`FAILED`).
    Not switched off by ``ZEROPP_CPU_NATIVE=0``: that switch is the quantization kernels'; an
    optimizer picks its kernel by name (``cpu_adam=``)."""
    return build_cache.load_once(sys.modules[__name__], load)


def available() -> bool:
    """Whether the kernel can run in this process (builds it if needed)."""
    return library() is not None


@lru_cache(maxsize=1)
def torch_sqrt() -> int | None:
    """The address of the routine torch's CPU ``sqrt`` uses for fp32 (MKL's ``vmsSqrt`` in torch's
    own library), or None when torch has no such routine or it does not reproduce ``torch.sqrt``
    on a probe of awkward values (then torch's sqrt is taken to be the IEEE one)."""
    if not torch.backends.mkl.is_available():
        return None
    lib_dir = Path(torch.__file__).parent / "lib"
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib"):
        try:
            fn = ctypes.CDLL(str(lib_dir / name)).vmsSqrt
            break
        except (OSError, AttributeError):
            continue
    else:
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    fn.restype = None
    f32: dict = dict(dtype=torch.float32, device="cpu")  # whatever torch's default dtype and device are
    probe = torch.cat(
        [
            torch.tensor([0.0, 1e-45, 3e-39, 0.5, 2.0, 1e38, float("inf")], **f32),
            torch.rand(4093, generator=torch.Generator().manual_seed(0), **f32) * 8,
        ]
    )
    out = torch.empty_like(probe)
    fn(probe.numel(), probe.data_ptr(), out.data_ptr(), _VML_MODE)
    if not torch.equal(out.view(torch.int32), probe.sqrt().view(torch.int32)):
        return None
    return ctypes.cast(fn, ctypes.c_void_p).value


@lru_cache(maxsize=1)
def reproduces_reference() -> bool:
    """Whether :func:`adamw` with ``exact=True`` gives :func:`adamw_reference`'s bits in this
    process (built and loaded, and checked on a probe: three updates, with and without weight
    decay, both branches of torch's ``lerp``, of awkward values: zeros, subnormals, huge and tiny
    gradients, a length that is no multiple of any vector width). What lets the runtime's default
    AdamW (``kernel="exact"``) run the kernel in place of torch's ops: a build or a torch whose
    square root the kernel does not reproduce answers False, and torch's ops run instead. The probe
    is fp32 on the CPU whatever torch's default dtype and device are."""
    if not available():
        return False
    f32: dict = dict(dtype=torch.float32, device="cpu")
    gen = torch.Generator().manual_seed(0)
    n = 4099
    special = torch.tensor([0.0, 1e-45, -3e-39, 1e-20, 1e20, -1e30, 0.5, -2.0], **f32)
    params = [torch.randn(n, generator=gen, **f32), torch.randn(n, generator=gen, **f32)]
    grads = [
        torch.cat([special, torch.randn(n - special.numel(), generator=gen, **f32) * 10 ** (k - 3)]) for k in range(2)
    ]

    def state() -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        zeros = [torch.zeros(n, **f32) for _ in params]
        return [t.clone() for t in params], zeros, [z.clone() for z in zeros]

    mine, ref = state(), state()  # (params, exp_avgs, exp_avg_sqs)
    try:
        for step, wd, betas in ((1, 0.1, (0.9, 0.999)), (2, 0.0, (0.9, 0.999)), (3, 0.01, (0.3, 0.95))):
            hp = AdamWStep(step=step, lr=1e-3, betas=betas, eps=1e-8, weight_decay=wd)
            adamw(mine[0], grads, mine[1], mine[2], hp, exact=True)
            adamw_reference(ref[0], grads, ref[1], ref[2], hp)
    except (RuntimeError, ValueError):
        return False
    return all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for x, y in zip(mine, ref) for a, b in zip(x, y))


def takes(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether :func:`adamw` can take every one of ``tensors`` (contiguous fp32 CPU tensors):
    where it cannot, the runtime's ``exact`` runs torch's ops instead of raising."""
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in tensors)


@dataclass(frozen=True, kw_only=True)
class AdamWStep:
    """The scalars of one AdamW update, and the two torch derives from them (in Python floats,
    as torch's single-tensor path computes them)."""

    step: int
    """The 1-based count of updates, this one included (the bias corrections' exponent)."""
    lr: float
    """The learning rate of this update."""
    betas: tuple[float, float]
    """Adam's (beta1, beta2): the moments' decay rates, each in [0, 1)."""
    eps: float
    """Added to the bias-corrected root of the second moment."""
    weight_decay: float
    """Decoupled weight decay (``p *= 1 - lr * weight_decay``; 0: none)."""

    def __post_init__(self) -> None:
        if self.step < 1:
            raise ValueError(f"AdamWStep step={self.step}: the count includes this update, so it is >= 1")
        if not all(0.0 <= b < 1.0 for b in self.betas) or len(self.betas) != 2:
            raise ValueError(f"AdamWStep betas={self.betas}: two values in [0, 1)")

    @property
    def step_size(self) -> float:
        """``lr / (1 - beta1**step)`` (torch keeps the step as a float tensor and reads ``.item()``)."""
        return self.lr / (1 - self.betas[0] ** float(self.step))

    @property
    def bias_correction2_sqrt(self) -> float:
        """``(1 - beta2**step) ** 0.5``."""
        return (1 - self.betas[1] ** float(self.step)) ** 0.5


def _f32(x: float) -> float:
    return float(struct.unpack("f", struct.pack("f", x))[0])


def _check(tensors: Sequence[Sequence[torch.Tensor]]) -> None:
    params = tensors[0]
    for group in tensors:
        if len(group) != len(params):
            raise ValueError(f"adamw: {len(params)} params but a list of {len(group)} tensors")
    for j, ts in enumerate(zip(*tensors)):
        for t in ts:
            if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(
                    f"adamw: tensor {j} is {t.dtype} on {t.device} (contiguous={t.is_contiguous()}); the native "
                    "CPU AdamW takes contiguous fp32 CPU tensors"
                )
            if t.numel() != ts[0].numel():
                raise ValueError(f"adamw: tensor {j}: {t.numel()} elements where its param has {ts[0].numel()}")


def adamw(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    hp: AdamWStep,
    *,
    exact: bool = False,
    threads: int | None = None,
) -> None:
    """One AdamW update of ``params``, ``exp_avgs`` and ``exp_avg_sqs`` in place (contiguous fp32
    CPU tensors, same sizes pairwise) with the scalars ``hp``.
    ``exact``: torch's own square root (bit-exact with :func:`adamw_reference`, see the module
    docstring). ``threads``: default ``torch.get_num_threads()``; 1 in a forked child (see
    :data:`FORKED`). Raises RuntimeError when the kernel is unavailable (:data:`FAILED` says why)."""
    global _RAN_PARALLEL
    _check([params, grads, exp_avgs, exp_avg_sqs])
    lib = library()
    if lib is None:
        raise RuntimeError(f"the native CPU AdamW kernel is unavailable: {FAILED}")
    beta1, beta2 = hp.betas
    w = 1 - beta1
    small = abs(_f32(w)) < 0.5  # ATen's lerp: w * (end - start) + start, else (w - 1) * (end - start) + end
    coeff = w if small else _f32(w) - 1.0
    sqrt_fn = torch_sqrt() if exact else None
    n_threads = 1 if FORKED else threads or torch.get_num_threads()
    _RAN_PARALLEL = _RAN_PARALLEL or n_threads > 1
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        rc = lib.za_adamw(
            p.data_ptr(),
            g.data_ptr(),
            m.data_ptr(),
            v.data_ptr(),
            p.numel(),
            int(hp.weight_decay != 0),
            1 - hp.lr * hp.weight_decay,
            coeff,
            int(small),
            beta2,
            1 - beta2,
            hp.bias_correction2_sqrt,
            hp.eps,
            -hp.step_size,
            sqrt_fn,
            _VML_MODE,
            n_threads,
        )
        if rc != 0:
            raise RuntimeError(f"zeropp.kernels.cpu_adamw: za_adamw failed (rc={rc}, threads={n_threads})")


@torch.no_grad()
def adamw_reference(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    hp: AdamWStep,
    *,
    ieee_sqrt: bool = False,
) -> None:
    """The same update in torch ops: the single-tensor path of ``torch.optim.AdamW`` (amsgrad,
    maximize and capturable off), operation for operation, so it gives torch's bits.
    ``ieee_sqrt``: the correctly rounded square root instead of torch's (taken in float64 and
    rounded once to fp32, which is the correctly rounded fp32 root since float64 carries more than
    twice fp32's 24 bits): then the bits are those of :func:`adamw` with ``exact=False``."""
    beta1, beta2 = hp.betas
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        if hp.weight_decay != 0:
            p.mul_(1 - hp.lr * hp.weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        root = v.double().sqrt().float() if ieee_sqrt else v.sqrt()
        denom = (root / hp.bias_correction2_sqrt).add_(hp.eps)
        p.addcdiv_(m, denom, value=-hp.step_size)


if __name__ == "__main__":  # python -m zeropp.kernels.cpu_adamw: build (or find) and load the kernel
    try:
        print(load()[1], f"(torch's sqrt routine {'found' if torch_sqrt() else 'not found: IEEE sqrt'})")
    except Exception as err:
        print(f"unavailable: {type(err).__name__}: {err}")
