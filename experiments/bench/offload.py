"""CPU AdamW kernels for ZeRO-Offload, and the nvme tier's swap bandwidth against the disk's own.

    python -m experiments.bench_offload                       # 1M,4M,16M,64M elements, 256 MiB swap test under /tmp
    python -m experiments.bench_offload --sizes 4M,16M --swap-mib 1024 --dir /mnt/nvme
    python -m experiments.bench_offload --json out.json

CPU AdamW: one update of each ``--sizes`` fp32 element count (one tensor: an offloaded shard is one
flat buffer) with each kernel: torch's single-tensor (``foreach=False``; the arithmetic the
in-memory engine uses), ``foreach``, ``fused`` (torch's fused CPU kernel), ``torch.compile`` of the
single-tensor step (``--compile``), zeropp's native kernel (``native``, and ``native-exact`` with
torch's own square root; ``zeropp.kernels.cpu_adamw``) and DeepSpeed's ``DeepSpeedCPUAdam`` when
``deepspeed`` is installed (``pip install 'zeropp[peers]'``; the row says so otherwise). All run on
the same ``torch.get_num_threads()`` threads (``--threads``; DeepSpeed's OpenMP loop too). The
steps are interleaved (one step of each kernel in turn, ``--repeat`` rounds, after a warm-up; each
round in an order of its own, a shuffle seeded by the round, so that no kernel always runs right
after the same one: all update the same buffers, and a kernel always timed after one that evicted
them from the cache, or after one that just brought them in, would be timed cold, or warm, every
round) and each time is the median. Each kernel is also checked against ``torch.optim.AdamW(foreach=False)``
after 3 steps on ``min(size, 65536)`` elements: "max |diff|" is the largest absolute weight
difference (0 = bit-identical). "vs fused" and "vs deepspeed" = that kernel's time / this time
(> 1: faster).

Swap bandwidth: what ``zeropp.runtime.swap.SwapSpace`` reaches moving a ``--swap-mib`` fp32
tensor into its preallocated file and back through its staging buffers (default 4 x 4M elements,
the ``ZeroConfig`` defaults) and I/O threads, next to the disk's own sequential bandwidth on a
file of the same size in the same directory, measured in the same run: a plain ``os.write`` loop
of 4 MiB blocks. Both writes end with ``fsync`` and are timed including it, so they measure the
disk (not only the page cache). Neither read drops the page cache (no root needed): both read
data just written, so on a machine with enough free memory both reads mostly measure the page
cache; the ratio swap / plain is the meaningful figure. Also reported: one ``SwappedAdamW`` step
streaming master, m and v of the first size's elements (at most 4M) (12 bytes per element each way).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, NoReturn

import torch

from zeropp.kernels import cpu_adamw
from zeropp.output_files import creation_refused, path_text_arg, write_output_file
from zeropp.runtime.config import OptimizerConfig
from zeropp.runtime.optimizer import adamw_update
from zeropp.runtime.swap import Segment, SwapSpace

from ..launch.command import run_command
from ..runner.console import human_bytes
from ..runner.preflight import host_memory
from ..runner.trainer_registry import TRAINER_SPECS
from .args import check_json_output, json_with_keys

CFG = OptimizerConfig(lr=1e-3, weight_decay=0.01)


def _state(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g), torch.randn(n, generator=g), torch.zeros(n), torch.zeros(n)


def _compiled_step() -> Callable[..., None]:
    """The single-tensor step under ``torch.compile``; the per-step scalars are 0-d tensors so
    that a new step (new bias corrections, new lr) does not recompile."""
    b1, b2 = CFG.betas

    @torch.compile(fullgraph=True, dynamic=False)
    def step(p, g, m, v, decay, step_size, bc2s):
        p.mul_(decay)
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        p.sub_(step_size * m / (v.sqrt() / bc2s + CFG.eps))

    def run(p, g, m, v, step_no: int, lr: float) -> None:
        t = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
        step(p, g, m, v, t(1 - lr * CFG.weight_decay), t(lr / (1 - b1**step_no)), t((1 - b2**step_no) ** 0.5))

    return run


PEERS_HINT = f"skipped: {TRAINER_SPECS['deepspeed'].install_hint}"
"""The DeepSpeed row's text when ``deepspeed`` cannot be imported (the trainer registry's hint)."""
PARITY_NUMEL = 1 << 16
"""Elements of the 3-step parity check against ``torch.optim.AdamW(foreach=False)``."""


def _deepspeed_step() -> Callable[..., None] | str:
    """A runner that steps ``DeepSpeedCPUAdam`` (AdamW mode) on its own parameter per buffer, or
    why it cannot (not installed; or its op failed to build: the error's first line)."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except ImportError:
        return PEERS_HINT
    opts: dict[int, Any] = {}

    def run(p, g, m, v, step_no: int, lr: float) -> None:
        # DeepSpeed keeps its own moments; m and v are unused (its state starts at zero like ours)
        if p.data_ptr() not in opts:
            param = torch.nn.Parameter(p)  # shares p's memory: the update lands in p
            opts[p.data_ptr()] = (
                param,
                DeepSpeedCPUAdam(
                    [param], lr=lr, betas=CFG.betas, eps=CFG.eps, weight_decay=CFG.weight_decay, adamw_mode=True
                ),
            )
        param, opt = opts[p.data_ptr()]
        param.grad = g
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()

    try:
        probe = torch.zeros(16)
        run(probe, probe.clone(), None, None, 1, CFG.lr)  # builds (or loads) its native op now
    except Exception as err:  # its JIT build needs a compiler and ninja
        return f"unavailable: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return run


def runners(compile_step: bool = False) -> dict[str, Callable[..., None] | str]:
    """Kernel name -> ``run(p, g, m, v, step, lr)`` (one update in place), or why it cannot run."""
    out: dict[str, Callable[..., None] | str] = {
        k: (lambda k: lambda p, g, m, v, s, lr: adamw_update([p], [g], [m], [v], step=s, lr=lr, cfg=CFG, kernel=k))(k)
        for k in ("single", "foreach", "fused", "native", "native-exact")
    }
    if not cpu_adamw.available():
        out["native"] = out["native-exact"] = f"unavailable: {cpu_adamw.FAILED}"
    if compile_step:
        out["compile"] = _compiled_step()
    out["deepspeed"] = _deepspeed_step()
    return out


def _parity(fn: Callable[..., None], n: int) -> float:
    """Max |weight difference| from ``torch.optim.AdamW(foreach=False)`` after 3 steps of ``n`` elements."""
    ref_p, g, _, _ = _state(n)
    ref = torch.nn.Parameter(ref_p.clone())
    opt = torch.optim.AdamW(
        [ref], lr=CFG.lr, betas=CFG.betas, eps=CFG.eps, weight_decay=CFG.weight_decay, foreach=False
    )
    p, _, m, v = _state(n)
    for s in range(1, 4):
        ref.grad = g.clone()
        opt.step()
        fn(p, g, m, v, s, CFG.lr)
    return float((p - ref.detach()).abs().max())


def bench_adam(n: int, repeat: int, run: dict[str, Callable[..., None] | str]) -> list[dict[str, Any]]:
    """Median seconds per AdamW step of ``n`` elements for each runnable kernel of ``run``
    (interleaved: one step of each in turn), with its max |diff|; a kernel that cannot run gets a
    row with its reason as ``skipped``."""
    ok = {k: fn for k, fn in run.items() if callable(fn)}
    diffs = {k: _parity(fn, min(n, PARITY_NUMEL)) for k, fn in ok.items()}
    state = _state(n)  # one state for all (the values do not change a step's time): memory stays 16 B/element
    times: dict[str, list[float]] = {k: [] for k in ok}
    for fn in ok.values():  # warm-up (and compilation)
        fn(*state, 1, CFG.lr)
    names = list(ok)
    for s in range(2, 2 + repeat):
        random.Random(s).shuffle(names)  # an order per round: no kernel always follows the same one
        for k in names:
            t0 = time.perf_counter()
            ok[k](*state, s, CFG.lr)
            times[k].append(time.perf_counter() - t0)
    rows: list[dict[str, Any]] = []
    for k, fn in run.items():
        if not callable(fn):
            rows.append({"kernel": k, "numel": n, "skipped": fn})
            continue
        sec = statistics.median(times[k])
        rows.append({"kernel": k, "numel": n, "seconds": sec, "max_abs_diff": diffs[k], "gelem_per_s": n / sec / 1e9})
    base = {r["kernel"]: r["seconds"] for r in rows if "seconds" in r}
    for r in rows:
        if "seconds" in r:
            r["vs_fused"] = base["fused"] / r["seconds"]
            r["vs_deepspeed"] = base["deepspeed"] / r["seconds"] if "deepspeed" in base else None
    return rows


def _plain_io(path: str, nbytes: int, block: int = 4 << 20) -> tuple[float, float]:
    """Seconds to write (buffered, then fsync) and read back ``nbytes`` sequentially."""
    buf = os.urandom(block)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        t0 = time.perf_counter()
        done = 0
        while done < nbytes:
            done += os.write(fd, buf[: min(block, nbytes - done)])
        os.fsync(fd)
        tw = time.perf_counter() - t0
        os.lseek(fd, 0, os.SEEK_SET)
        t0 = time.perf_counter()
        while os.read(fd, block):
            pass
        tr = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)
    return tw, tr


def bench_swap(directory: str, mib: int, buffers: int, buffer_size: int, adam_numel: int) -> dict[str, Any]:
    nbytes = mib << 20
    numel = nbytes // 4
    src = torch.randn(numel)
    sp = SwapSpace(directory, 0, buffers=buffers, buffer_size=buffer_size)
    try:
        f = sp.create("bench.swp", nbytes)
        seg = Segment(f, 0, numel, torch.float32)
        t0 = time.perf_counter()
        sp.write_from(seg, src)
        os.fsync(f.fd)
        tw = time.perf_counter() - t0
        out = torch.empty_like(src)
        t0 = time.perf_counter()
        sp.read_into(seg, out)
        tr = time.perf_counter() - t0
        assert torch.equal(out, src), "swap round trip corrupted the data"
        del out
        from zeropp.runtime.offload import DEFAULT_CPU_KERNEL, SwappedAdamW

        opt = SwappedAdamW([torch.randn(adam_numel)], CFG, space=sp, kernel=DEFAULT_CPU_KERNEL)
        grad = torch.randn(adam_numel)
        opt.step([grad])  # warm-up
        t0 = time.perf_counter()
        opt.step([grad])
        ta = time.perf_counter() - t0
    finally:
        sp.close()
    pw, pr = _plain_io(os.path.join(directory, f".bench_offload_plain_{os.getpid()}"), nbytes)
    gb = nbytes / 1e9
    return {
        "bytes": nbytes,
        "swap_write_gbps": gb / tw,
        "swap_read_gbps": gb / tr,
        "disk_write_gbps": gb / pw,
        "disk_read_gbps": gb / pr,
        "write_ratio": pw / tw,
        "read_ratio": pr / tr,
        "swapped_adam_step_s": ta,
        "swapped_adam_gbps": 24 * adam_numel / ta / 1e9,
        "staging_bytes": buffers * buffer_size * 4,
    }


def _size(text: str) -> int:
    """``4M`` / ``64k`` / ``1048576`` -> elements (k, M, G are powers of 1024)."""
    t = text.strip()
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(t[-1:].lower(), 1)
    num = t[:-1] if mult > 1 else t
    if not num.isdigit() or int(num) < 1:
        raise ValueError(f"{text!r} is not a size (a positive count, optionally with k, M or G: 4M)")
    return int(num) * mult


def adam_table(adam: list[dict[str, Any]], threads: int, repeat: int) -> list[str]:
    """The CPU AdamW rows as a markdown table (skipped kernels say why)."""
    lines = [
        f"CPU AdamW, fp32, {threads} threads for every kernel, median of {repeat} interleaved steps:",
        "| elements | kernel | ms/step | Gelem/s | vs fused | vs deepspeed | max abs diff vs torch AdamW(foreach=False) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in adam:
        if "skipped" in r:
            lines.append(f"| {r['numel']} | {r['kernel']} | {r['skipped']} | | | | |")
            continue
        vs_ds = "" if r["vs_deepspeed"] is None else f"{r['vs_deepspeed']:.2f}x"
        lines.append(
            f"| {r['numel']} | {r['kernel']} | {r['seconds'] * 1e3:.2f} | {r['gelem_per_s']:.3f} | "
            f"{r['vs_fused']:.2f}x | {vs_ds} | {r['max_abs_diff']:.3g} |"
        )
    return lines


def format_report(adam: list[dict[str, Any]], swap: dict[str, Any] | None, a: argparse.Namespace) -> str:
    lines = adam_table(adam, torch.get_num_threads(), a.repeat)
    if swap is None:
        return "\n".join(lines)
    s = swap
    lines += [
        "",
        f"Swap vs plain sequential I/O, {s['bytes'] >> 20} MiB in {a.dir} "
        f"(staging {s['staging_bytes'] >> 20} MiB = {a.buffers} x {a.buffer_size} fp32):",
        "| | swap GB/s | plain GB/s | swap / plain |",
        "|---|---|---|---|",
        f"| write (+fsync) | {s['swap_write_gbps']:.2f} | {s['disk_write_gbps']:.2f} | {s['write_ratio']:.2f} |",
        f"| read (page cache not dropped) | {s['swap_read_gbps']:.2f} | {s['disk_read_gbps']:.2f} "
        f"| {s['read_ratio']:.2f} |",
        "",
        f"SwappedAdamW step, {a.swap_numel} elements (master+m+v read and written): "
        f"{s['swapped_adam_step_s'] * 1e3:.1f} ms, {s['swapped_adam_gbps']:.2f} GB/s of swap traffic",
    ]
    return "\n".join(lines)


JSON_SHAPE = json_with_keys("adam", "swap", "args")
"""What ``--json`` writes: an earlier run's file of this shape may be replaced, nothing else."""


BYTES_PER_ELEMENT = 32
"""Host memory per AdamW element the benchmark may touch: 16 bytes of state (fp32 parameter,
gradient and two moments, one state shared by every kernel) and up to as much again of a kernel's
temporaries (the single-tensor reference computes its update in whole-tensor steps)."""


def _check_room(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Refuse sizes this host cannot hold (before: the kernel's out-of-memory killer ended the
    process, SIGKILL, no message) and a swap test larger than the free space of ``--dir``."""
    need, have = BYTES_PER_ELEMENT * max(a.numels), host_memory()
    if need > have:
        p.error(
            f"--sizes {a.sizes}: {max(a.numels):,} elements need about {human_bytes(need)} of host memory "
            f"({BYTES_PER_ELEMENT} B per element) but this host has {human_bytes(have)}; give smaller sizes"
        )
    if a.swap_mib:
        free = shutil.disk_usage(a.dir).free
        if 2 * (a.swap_mib << 20) > free:  # the swapped state and the plain I/O file
            p.error(
                f"--swap-mib {a.swap_mib} writes about {human_bytes(2 * (a.swap_mib << 20))} to --dir {a.dir}, "
                f"which has {human_bytes(free)} free; lower --swap-mib or choose another --dir"
            )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.bench_offload", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1M,4M,16M,64M", help="fp32 elements of the AdamW benchmarks (k/M/G = 1024^n)")
    p.add_argument("--repeat", type=int, default=7, help="timed steps per kernel (median)")
    p.add_argument("--threads", type=int, default=None, help="threads of every kernel (default: torch's)")
    p.add_argument("--compile", action="store_true", help="also time torch.compile of the single-tensor step")
    p.add_argument("--swap-mib", type=int, default=256, help="MiB moved by the swap / plain I/O test (0: skip it)")
    p.add_argument(
        "--dir",
        type=path_text_arg,
        default=tempfile.gettempdir(),
        help="directory of the swap test (the disk measured)",
    )
    p.add_argument("--buffers", type=int, default=4, help="staging buffers (ZeroConfig.swap_buffers)")
    p.add_argument("--buffer-size", type=int, default=1 << 22, help="fp32 elements per buffer (swap_buffer_size)")
    p.add_argument("--json", type=path_text_arg, default=None, help="also write the figures to this JSON file")
    a = p.parse_args(argv)
    try:
        a.numels = [_size(t) for t in a.sizes.split(",")]
    except ValueError as e:
        p.error(f"--sizes: {e}")
    a.swap_numel = min(a.numels[0], 1 << 22)
    for k in ("repeat", "buffer_size"):
        if getattr(a, k) < 1:
            p.error(f"--{k.replace('_', '-')} must be >= 1")
    if a.swap_mib < 0:
        p.error("--swap-mib must be >= 0")
    if a.threads is not None and a.threads < 1:
        p.error("--threads must be >= 1")
    if a.buffers < 2:
        p.error("--buffers must be >= 2")
    if not os.path.isdir(a.dir):
        p.error(f"--dir {a.dir} is not a directory")
    err = creation_refused(Path(a.dir)) if a.swap_mib else None  # mode bits lie for root and read-only mounts
    if err is not None:
        p.error(f"--dir {a.dir} cannot take the swap test's files ({err.strerror or err}); choose a writable directory")
    _check_room(p, a)
    check_json_output(p, a.json, "--json", JSON_SHAPE)
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    adam: list[dict[str, Any]] = []
    for n in a.numels:  # fresh runners per size: DeepSpeed's optimizers hold their buffers
        adam += bench_adam(n, a.repeat, runners(a.compile))
    swap = bench_swap(a.dir, a.swap_mib, a.buffers, a.buffer_size, a.swap_numel) if a.swap_mib else None
    print(format_report(adam, swap, a))
    if a.json:
        write_output_file(Path(a.json), json.dumps({"adam": adam, "swap": swap, "args": vars(a)}, indent=1))
    return 0


def cli() -> NoReturn:
    """The command: :func:`main`, ended by ``launch.command.run_command`` (Ctrl-C or a failed world
    is one ``error:`` line and the shell's exit status, never a traceback)."""
    run_command(main)


if __name__ == "__main__":
    cli()
