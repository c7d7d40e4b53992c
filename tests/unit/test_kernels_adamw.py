"""The native CPU AdamW kernel (kernels/cpu_adamw.py) against ``torch.optim.AdamW(foreach=False)``.

Tolerances: ``exact=True`` takes torch's own square root, so p, m and v must be bit-identical to
torch's after every step (``torch.equal``). ``exact=False`` uses the IEEE square root, which differs
from MKL's (torch's) by 1 ulp on some elements: m and v never depend on it (bit-identical), and a
weight then moves by at most 1 ulp of itself per step plus the update's own relative rounding
(2**-23 of at most ``lr / (1 - beta1**t)``-sized steps), so the bound below is ``steps`` times that.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
import types
import warnings

import pytest
import torch

from tests.kernel_helpers import failing_compiler
from zeropp.kernels import build_cache, cpu_adamw, cpu_native
from zeropp.runtime import optimizer
from zeropp.runtime.config import OptimizerConfig

EPS32 = torch.finfo(torch.float32).eps
SHAPES = [(1,), (7,), (17, 257)]
BIG = (4 << 20,)
"""Two threads' parts, each with a SIMD body and a tail (only where it matters: a 4M run costs seconds)."""


def _native_or_skip() -> None:
    if not cpu_adamw.available():
        pytest.skip(f"native CPU AdamW unavailable here: {cpu_adamw.FAILED}")


def _torch_run(shape, steps, *, lr, betas, wd, exact, threads=None):
    """(torch's p, m, v) and (the kernel's p, m, v) after ``steps`` updates from the same start."""
    g = torch.Generator().manual_seed(shape[0])
    p0 = torch.randn(shape, generator=g)
    grads = [torch.randn(shape, generator=g) for _ in range(steps)]
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([ref], lr=lr, betas=betas, eps=1e-8, weight_decay=wd, foreach=False)
    p, m, v = p0.clone(), torch.zeros(shape), torch.zeros(shape)
    for s, grad in enumerate(grads, 1):
        ref.grad = grad.clone()
        opt.step()
        hp = cpu_adamw.AdamWStep(step=s, lr=lr, betas=betas, eps=1e-8, weight_decay=wd)
        cpu_adamw.adamw([p], [grad], [m], [v], hp, exact=exact, threads=threads)
    st = opt.state[ref]
    return (ref.detach(), st["exp_avg"], st["exp_avg_sq"]), (p, m, v)


@pytest.mark.parametrize(
    ("shape", "betas", "wd"),
    [*(((s, (0.9, 0.999), 0.01)) for s in (*SHAPES, BIG)), *(((s, (0.3, 0.95), 0.0)) for s in SHAPES)],
    ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) and isinstance(x[0], int) and x[0] >= 1 else None,
)
def test_exact_kernel_is_torch_adamw_bit_for_bit(shape, betas, wd) -> None:
    """Sizes 1 and 7 (no SIMD body), 17x257 (body and tail), 4M (two threads); beta1 = 0.3 takes
    lerp's other branch (weight 0.7 >= 0.5); weight decay on and off; 4 steps (bias correction)."""
    _native_or_skip()
    if cpu_adamw.torch_sqrt() is None:
        pytest.skip("torch's sqrt routine is not MKL's here: exact=True uses the IEEE root, not promised exact")
    want, got = _torch_run(shape, 4, lr=1e-3, betas=betas, wd=wd, exact=True)
    for name, a, b in zip("pmv", got, want):
        assert torch.equal(a, b), (name, int((a != b).sum()))


@pytest.mark.parametrize("shape", (*SHAPES, BIG), ids=lambda s: "x".join(map(str, s)))
def test_ieee_sqrt_kernel_is_within_an_ulp_per_step(shape) -> None:
    _native_or_skip()
    steps, lr = 4, 1e-3
    want, got = _torch_run(shape, steps, lr=lr, betas=(0.9, 0.999), wd=0.01, exact=False)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])  # m, v: no square root involved
    bound = steps * EPS32 * (want[0].abs() + lr / (1 - 0.9**steps))
    assert bool(((got[0] - want[0]).abs() <= bound).all()), float((got[0] - want[0]).abs().max())


IEEE_SHAPES = [(1,), (127,), (128 + 16 + 3,), (17, 257), ((1 << 16) * 3 + 1000,)]
"""Below one step of the vector loop (SPAN x lanes = 128 with AVX-512), a step plus a vector plus
a scalar tail, and several tiles of 65536 elements taken by two threads."""


def _ieee_run(lib, shape, *, betas, wd, threads=2, steps=3):
    """(reference p, m, v) with the correctly rounded root and the library's (exact=False) after ``steps``."""
    g = torch.Generator().manual_seed(len(shape) + shape[0])
    p0 = torch.randn(shape, generator=g)
    grads = [torch.randn(shape, generator=g) for _ in range(steps)]
    want = [p0.clone(), torch.zeros(shape), torch.zeros(shape)]
    got = [p0.clone(), torch.zeros(shape), torch.zeros(shape)]
    for s, grad in enumerate(grads, 1):
        hp = cpu_adamw.AdamWStep(step=s, lr=1e-2, betas=betas, eps=1e-8, weight_decay=wd)
        cpu_adamw.adamw_reference(*([t] for t in (want[0], grad, want[1], want[2])), hp, ieee_sqrt=True)
        lib_before = cpu_adamw._LIB
        cpu_adamw._LIB = lib
        try:
            cpu_adamw.adamw([got[0]], [grad], [got[1]], [got[2]], hp, threads=threads)
        finally:
            cpu_adamw._LIB = lib_before
    return want, got


@pytest.mark.parametrize("shape", IEEE_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize(("betas", "wd"), [((0.9, 0.999), 0.1), ((0.3, 0.95), 0.0)], ids=["decay", "lerp-hi"])
def test_ieee_sqrt_kernel_is_the_ieee_reference_bit_for_bit(shape, betas, wd) -> None:
    """``exact=False`` is torch's arithmetic with the correctly rounded root, bit for bit, in the
    vector loop (AVX-512 or AVX2 where compiled in), its vector and scalar tails, and across tiles."""
    _native_or_skip()
    want, got = _ieee_run(cpu_adamw.library(), shape, betas=betas, wd=wd)
    for name, a, b in zip("pmv", got, want):
        assert torch.equal(a, b), (name, int((a != b).sum()))


def test_the_avx2_build_gives_the_same_bits(tmp_path) -> None:
    """The library built without AVX-512 (the AVX2 vector code, what AVX2-only CPUs run) gives the
    reference's bits too (the loop gcc vectorises is every build's tail, checked above)."""
    _native_or_skip()
    _, build = cpu_native.named_build(cpu_adamw.SOURCE, [*cpu_adamw.FLAGS, "-mno-avx512f"], "za")
    build(tmp_path / "narrow.so")
    lib = cpu_adamw._load(str(tmp_path / "narrow.so"))
    want, got = _ieee_run(lib, (128 * 3 + 16 + 5,), betas=(0.9, 0.999), wd=0.1, threads=1)
    for name, a, b in zip("pmv", got, want):
        assert torch.equal(a, b), (name, int((a != b).sum()))


def _openmp_runtimes() -> set[str]:
    """The OpenMP runtime files mapped into this process (Linux: from /proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        return {line.split()[-1] for line in maps if "libgomp" in line or "libomp" in line or "libiomp" in line}


def test_the_kernel_runs_on_torchs_openmp_runtime() -> None:
    """Loading the kernel maps no second OpenMP runtime: it shares torch's team (a second one
    would start threads of its own beside torch's, competing for the same cores)."""
    if not sys.platform.startswith("linux") or "OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("torch is not built on OpenMP here, or /proc/self/maps is missing")
    torch.ones(1 << 16).add_(1)  # torch's runtime is in use before the kernel loads
    before = _openmp_runtimes()
    _native_or_skip()
    assert len(before) == 1 and _openmp_runtimes() == before, (before, _openmp_runtimes())


def _step_in_child(tensors, queue) -> None:
    hp = cpu_adamw.AdamWStep(step=2, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    cpu_adamw.adamw(*([t] for t in tensors), hp, threads=2)
    queue.put([t.numpy().tobytes() for t in tensors])  # no torch op: torch's own would hang in a child


@pytest.mark.skipif(not hasattr(os, "register_at_fork"), reason="no fork on this platform")
def test_a_forked_child_steps_instead_of_hanging() -> None:
    """A process forked after the kernel ran on two threads (libgomp's team is not copied by
    fork: a parallel region in the child would wait forever) steps on one thread, same bits."""
    _native_or_skip()
    g = torch.Generator().manual_seed(1)
    tensors = [torch.randn(1 << 17, generator=g), torch.randn(1 << 17, generator=g), torch.zeros(1 << 17)]
    tensors.append(torch.zeros(1 << 17))
    hp = cpu_adamw.AdamWStep(step=1, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    cpu_adamw.adamw(*([t] for t in tensors), hp, threads=2)  # the parent's OpenMP team now exists
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_step_in_child, args=(tensors, queue))
    child.start()
    try:
        got = queue.get(timeout=60)
    finally:
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
            child.join()
    _step_in_child(tensors, queue)  # the same step here, on two threads
    assert child.exitcode == 0 and got == queue.get(timeout=10)


FORK_BEFORE_ANY_STEP = """
import multiprocessing
from zeropp.kernels import cpu_adamw
ctx = multiprocessing.get_context("fork")
queue = ctx.Queue()
child = ctx.Process(target=lambda: queue.put(cpu_adamw.FORKED))
child.start()
print(queue.get(timeout=60), cpu_adamw.FORKED)
child.join()
"""


def test_a_child_of_a_process_that_never_stepped_keeps_its_threads() -> None:
    """A forkserver imports the kernel and forks ranks without running it: they keep their threads."""
    out = subprocess.run([sys.executable, "-c", FORK_BEFORE_ANY_STEP], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["False", "False"], out.stderr[-2000:]


@pytest.mark.parametrize("exact", [False, True], ids=["ieee", "exact"])
def test_the_result_does_not_depend_on_the_thread_count(exact: bool) -> None:
    """1, 2 and 5 threads give the same bits, with the tiles each count cuts (one range; 8 tiles of
    37,888 elements; 19 of 16,384, the smallest, taken in whatever order the threads come), and with
    torch's square root they are torch's bits: tiles start at whole blocks whatever their size."""
    _native_or_skip()
    g = torch.Generator().manual_seed(0)
    p0, grad = torch.randn(300_001, generator=g), torch.randn(300_001, generator=g)
    outs = []
    for threads in (1, 2, 5):
        p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
        for s in (1, 2):
            hp = cpu_adamw.AdamWStep(step=s, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
            cpu_adamw.adamw([p], [grad], [m], [v], hp, exact=exact, threads=threads)
        outs.append((p, m, v))
    assert all(torch.equal(a, b) for other in outs[1:] for a, b in zip(outs[0], other))
    if exact and cpu_adamw.torch_sqrt() is not None:
        want = (p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0))
        for s in (1, 2):
            hp = cpu_adamw.AdamWStep(step=s, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
            cpu_adamw.adamw_reference([want[0]], [grad], [want[1]], [want[2]], hp)
        assert all(torch.equal(a, b) for a, b in zip(outs[1], want))


def test_bad_tensors_are_refused_with_what_to_change() -> None:
    _native_or_skip()
    kw = dict(hp=cpu_adamw.AdamWStep(step=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0))
    x = torch.zeros(8)
    with pytest.raises(ValueError, match=r"tensor 0 is torch.bfloat16 on cpu.*contiguous fp32 CPU tensors"):
        cpu_adamw.adamw([x.bfloat16()], [x], [x], [x], **kw)
    with pytest.raises(ValueError, match=r"contiguous=False"):
        cpu_adamw.adamw([torch.zeros(4, 4).t()], [x], [x], [x], **kw)
    with pytest.raises(ValueError, match="tensor 0: 7 elements where its param has 8"):
        cpu_adamw.adamw([x], [torch.zeros(7)], [x], [x], **kw)
    with pytest.raises(ValueError, match="1 params but a list of 2 tensors"):
        cpu_adamw.adamw([x], [x, x], [x], [x], **kw)
    with pytest.raises(ValueError, match=r"step=0: the count includes this update"):
        cpu_adamw.AdamWStep(step=0, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    with pytest.raises(ValueError, match=r"betas=\(0.9, 1.0\): two values in \[0, 1\)"):
        cpu_adamw.AdamWStep(step=1, lr=1e-3, betas=(0.9, 1.0), eps=1e-8, weight_decay=0.0)
    with pytest.raises(ValueError, match="runs on CPU tensors only, not on meta"):
        optimizer.adamw_update(
            [torch.zeros(8, device="meta")], [x], [x], [x], step=1, lr=1e-3, cfg=OptimizerConfig(), kernel="native"
        )


def test_a_failed_build_falls_back_with_one_warning(tmp_path, monkeypatch) -> None:
    """A compiler that fails: ``native`` runs torch's fused kernel and ``native-exact`` the
    single-tensor path (their exact results), with one warning naming the failure; ``exact`` (the
    in-memory default) runs the single-tensor path without a warning (the same bits either way)."""
    failing_compiler(tmp_path, monkeypatch)
    monkeypatch.setattr(cpu_adamw, "_LIB", None)
    monkeypatch.setattr(cpu_adamw, "FAILED", None)
    monkeypatch.setattr(optimizer, "_warned_fallback", False)
    cpu_adamw.reproduces_reference.cache_clear()
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    p0, grad = torch.randn(1000, generator=g), torch.randn(1000, generator=g)

    def run(kernel: str) -> torch.Tensor:
        p, m, v = p0.clone(), torch.zeros(1000), torch.zeros(1000)
        optimizer.adamw_update([p], [grad], [m], [v], step=1, lr=cfg.lr, cfg=cfg, kernel=kernel)
        return p

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert torch.equal(run("exact"), run("single")) and not cpu_adamw.reproduces_reference()
        with pytest.warns(
            RuntimeWarning, match=r"native CPU AdamW kernel is unavailable \(RuntimeError: .*failed"
        ) as rec:
            assert torch.equal(run("native"), run("fused"))
        assert len(rec) == 1
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once per process
            assert torch.equal(run("native-exact"), run("single"))
    finally:
        cpu_adamw.reproduces_reference.cache_clear()  # re-probed once the fake build is undone


def test_load_once_records_a_failure_and_does_not_retry() -> None:
    owner = types.ModuleType("fake_loader")
    owner._LIB, owner.FAILED, owner._LOCK = None, None, threading.Lock()
    calls = []

    def load():
        calls.append(1)
        raise OSError("no such library")

    assert build_cache.load_once(owner, load) is None and build_cache.load_once(owner, load) is None
    assert calls == [1] and owner.FAILED == "OSError: no such library"


def _spy_native(monkeypatch) -> list[int]:
    """Count the native kernel's calls (and run it)."""
    calls: list[int] = []
    real = cpu_adamw.adamw

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_adamw, "adamw", spy)
    return calls


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_default_kernel_is_torch_adamw_bit_for_bit(shape, monkeypatch) -> None:
    """The runtime's default (``exact``, what every in-memory stage runs) gives torch's single-tensor
    bits, and takes the native kernel where the probe says it reproduces them."""
    cpu_adamw.reproduces_reference()  # (probed before the spy, which then counts the steps' calls only)
    calls = _spy_native(monkeypatch)
    cfg = OptimizerConfig(lr=1e-3, weight_decay=0.01)
    g = torch.Generator().manual_seed(1)
    p0 = torch.randn(shape, generator=g)
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW(
        [ref], lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, foreach=False
    )
    mine = optimizer.ShardedAdamW([p0.clone().reshape(-1)], cfg)
    assert mine.kernel == "exact"
    for _ in range(3):
        grad = torch.randn(shape, generator=g)
        ref.grad = grad.clone()
        opt.step()
        mine.step([grad.reshape(-1)])
    assert torch.equal(mine.masters[0], ref.detach().reshape(-1))
    assert torch.equal(mine.exp_avg_sq[0], opt.state[ref]["exp_avg_sq"].reshape(-1))
    assert bool(calls) == cpu_adamw.reproduces_reference()


def test_the_default_kernel_runs_torchs_ops_where_the_native_bits_differ(monkeypatch) -> None:
    """A native kernel whose bits are not torch's (here: one element nudged by an ulp) fails the
    probe, and ``exact`` then runs torch's own ops: the same bits, never the kernel's."""
    _native_or_skip()
    real = cpu_adamw.adamw

    def off_by_an_ulp(params, *args, **kwargs):
        real(params, *args, **kwargs)
        params[0].view(torch.int32)[-1] += 1

    monkeypatch.setattr(cpu_adamw, "adamw", off_by_an_ulp)
    cpu_adamw.reproduces_reference.cache_clear()
    try:
        assert not cpu_adamw.reproduces_reference()
        assert optimizer._native_or_fallback("exact", [torch.zeros(3)]) == "single"
    finally:
        cpu_adamw.reproduces_reference.cache_clear()


def test_the_default_kernel_off_the_cpu_runs_torchs_ops() -> None:
    """Off the CPU (a GPU's tensors; ``meta`` here) ``exact`` is torch's own ops, where ``native`` is refused."""
    x = torch.zeros(8, device="meta")
    cfg = OptimizerConfig()
    optimizer.adamw_update([torch.zeros(8, device="meta")], [x], [x], [x], step=1, lr=1e-3, cfg=cfg, kernel="exact")


def test_the_default_kernel_takes_what_torchs_ops_take() -> None:
    """Where torch's single-tensor AdamW works, so does ``exact``, with its bits: under another
    default dtype (the probe is fp32 on the CPU regardless; it raised before) and on tensors the
    native kernel cannot take (a transposed view: torch's ops run)."""
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(3)
    p0, grad = torch.randn(17, 257, generator=g), torch.randn(17, 257, generator=g)

    def run(kernel: str, view) -> torch.Tensor:
        p, m, v = (view(t) for t in (p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)))
        for step in (1, 2):
            optimizer.adamw_update([p], [view(grad)], [m], [v], step=step, lr=cfg.lr, cfg=cfg, kernel=kernel)
        return p

    before = torch.get_default_dtype()
    cpu_adamw.reproduces_reference.cache_clear()
    cpu_adamw.torch_sqrt.cache_clear()
    torch.set_default_dtype(torch.float64)
    try:
        assert torch.equal(run("exact", lambda t: t), run("single", lambda t: t))
        if cpu_adamw.available() and torch.backends.mkl.is_available():  # (where the fp32 probes found MKL's sqrt)
            assert cpu_adamw.torch_sqrt() is not None and cpu_adamw.reproduces_reference()
    finally:
        torch.set_default_dtype(before)
        cpu_adamw.reproduces_reference.cache_clear()
        cpu_adamw.torch_sqrt.cache_clear()
    assert torch.equal(run("exact", lambda t: t.t()), run("single", lambda t: t.t()))
