"""CPU AdamW kernels for ZeRO-Offload, and the nvme tier's swap bandwidth against the disk's own.

    python -m experiments.bench_offload                       # 4M elements, 256 MiB swap test under /tmp
    python -m experiments.bench_offload --numel 16777216 --swap-mib 1024 --dir /mnt/nvme
    python -m experiments.bench_offload --json out.json

CPU AdamW: one update of ``--numel`` fp32 elements (one tensor: an offloaded shard is one flat
buffer) with each of torch's AdamW paths: single-tensor (``foreach=False``; the arithmetic the
in-memory engine uses), ``foreach``, ``fused`` (torch's fused CPU kernel) and ``torch.compile`` of
the single-tensor step. Each is timed as the median of ``--repeat`` steps after a warm-up, and
checked against ``torch.optim.AdamW(foreach=False)`` after 3 steps on the same data: "max |diff|"
is the largest absolute weight difference (0 = bit-identical). Column "vs foreach" = foreach's
time / this time (> 1: faster than foreach). DeepSpeed's claim for its CPU Adam is 5-7x against
"PyTorch" (its baseline was the single-tensor path of its day).

Swap bandwidth: what ``zeropp.runtime.swap.SwapSpace`` reaches moving a ``--swap-mib`` fp32
tensor into its preallocated file and back through its staging buffers (default 4 x 4M elements,
the ``ZeroConfig`` defaults) and I/O threads, next to the disk's own sequential bandwidth on a
file of the same size in the same directory, measured in the same run: a plain ``os.write`` loop
of 4 MiB blocks. Both writes end with ``fsync`` and are timed including it, so they measure the
disk (not only the page cache). Neither read drops the page cache (no root needed): both read
data just written, so on a machine with enough free memory both reads mostly measure the page
cache; the ratio swap / plain is the meaningful figure. Also reported: one ``SwappedAdamW`` step
streaming master, m and v of ``--numel`` elements (12 bytes per element each way).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any, Callable

import torch

from zeropp.runtime.config import OptimizerConfig
from zeropp.runtime.optimizer import adamw_update
from zeropp.runtime.swap import Segment, SwapSpace

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


def bench_adam(n: int, repeat: int) -> list[dict[str, Any]]:
    """Median seconds per AdamW step of ``n`` elements for each kernel, with its max |diff|."""
    ref_p, g, _, _ = _state(n)
    ref = torch.nn.Parameter(ref_p.clone())
    opt = torch.optim.AdamW(
        [ref], lr=CFG.lr, betas=CFG.betas, eps=CFG.eps, weight_decay=CFG.weight_decay, foreach=False
    )
    for _ in range(3):
        ref.grad = g.clone()
        opt.step()
    compiled = _compiled_step()
    runners: dict[str, Callable[..., None]] = {
        k: (lambda k: lambda p, g, m, v, s, lr: adamw_update([p], [g], [m], [v], step=s, lr=lr, cfg=CFG, kernel=k))(k)
        for k in ("single", "foreach", "fused")
    }
    runners["compile"] = compiled
    rows = []
    for name, fn in runners.items():
        p, g, m, v = _state(n)
        for s in range(1, 4):  # the parity check; also the warm-up (and the compilation)
            fn(p, g, m, v, s, CFG.lr)
        diff = float((p - ref.detach()).abs().max())
        times = []
        for s in range(4, 4 + repeat):
            t0 = time.perf_counter()
            fn(p, g, m, v, s, CFG.lr)
            times.append(time.perf_counter() - t0)
        rows.append({"kernel": name, "seconds": statistics.median(times), "max_abs_diff": diff})
    foreach = next(r["seconds"] for r in rows if r["kernel"] == "foreach")
    for r in rows:
        r["vs_foreach"] = foreach / r["seconds"]
        r["gelem_per_s"] = n / r["seconds"] / 1e9
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
        from zeropp.runtime.offload import SwappedAdamW

        opt = SwappedAdamW([torch.randn(adam_numel)], CFG, space=sp, kernel="fused")
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


def format_report(adam: list[dict[str, Any]], swap: dict[str, Any], a: argparse.Namespace) -> str:
    lines = [
        f"CPU AdamW, {a.numel} fp32 elements, {torch.get_num_threads()} threads, median of {a.repeat}:",
        "| kernel | ms/step | Gelem/s | vs foreach | max abs diff vs torch AdamW(foreach=False) |",
        "|---|---|---|---|---|",
    ]
    for r in adam:
        lines.append(
            f"| {r['kernel']} | {r['seconds'] * 1e3:.2f} | {r['gelem_per_s']:.3f} | {r['vs_foreach']:.2f}x "
            f"| {r['max_abs_diff']:.3g} |"
        )
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
        f"SwappedAdamW step, {a.numel} elements (master+m+v read and written): "
        f"{s['swapped_adam_step_s'] * 1e3:.1f} ms, {s['swapped_adam_gbps']:.2f} GB/s of swap traffic",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.bench_offload", description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=1 << 22, help="fp32 elements of the AdamW benchmarks")
    p.add_argument("--repeat", type=int, default=7, help="timed steps per kernel (median)")
    p.add_argument("--swap-mib", type=int, default=256, help="MiB moved by the swap / plain I/O test")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="directory of the swap test (the disk measured)")
    p.add_argument("--buffers", type=int, default=4, help="staging buffers (ZeroConfig.swap_buffers)")
    p.add_argument("--buffer-size", type=int, default=1 << 22, help="fp32 elements per buffer (swap_buffer_size)")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    a = p.parse_args(argv)
    for k in ("numel", "repeat", "swap_mib", "buffer_size"):
        if getattr(a, k) < 1:
            p.error(f"--{k.replace('_', '-')} must be >= 1")
    if a.buffers < 2:
        p.error("--buffers must be >= 2")
    if not os.path.isdir(a.dir):
        p.error(f"--dir {a.dir} is not a directory")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    adam = bench_adam(a.numel, a.repeat)
    swap = bench_swap(a.dir, a.swap_mib, a.buffers, a.buffer_size, a.numel)
    print(format_report(adam, swap, a))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"adam": adam, "swap": swap, "args": vars(a)}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
