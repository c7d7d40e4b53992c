"""Host enqueue cost of one quantize / dequantize call on CUDA (no sync between calls), against
torch's own copy, plus a cProfile of the quantize host path. Run on a GPU machine (part of
scripts/gpu_check.sh)."""

import cProfile
import pstats
import time

import torch

from zeropp.kernels import dequantize, quantize

x = torch.randn(32768, device="cuda", dtype=torch.bfloat16)
y = torch.empty_like(x)
for _ in range(50):
    q = quantize(x, 8, 512)
    dequantize(q, dtype=torch.bfloat16)
torch.cuda.synchronize()


def per_call(fn, n=2000):
    for _ in range(20):  # compiled and cached first: a variant's first call compiles its kernel
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n
    torch.cuda.synchronize()
    return host * 1e6


print(f"copy_       host us/call {per_call(lambda: y.copy_(x)):.1f}")
print(f"quantize    host us/call {per_call(lambda: quantize(x, 8, 512)):.1f}")
print(f"dequantize  host us/call {per_call(lambda: dequantize(q, dtype=torch.bfloat16)):.1f}")
print(f"quantize4s  host us/call {per_call(lambda: quantize(x, 4, 128, stochastic=True, seed=3)):.1f}")
pr = cProfile.Profile()
pr.enable()
for _ in range(2000):
    quantize(x, 8, 512)
pr.disable()
torch.cuda.synchronize()
pstats.Stats(pr).sort_stats("tottime").print_stats(18)

from triton.testing import do_bench  # noqa: E402

for name, fn in (
    ("copy_", lambda: y.copy_(x)),
    ("quantize int8", lambda: quantize(x, 8, 512)),
    ("quantize int4 stochastic", lambda: quantize(x, 4, 128, stochastic=True, seed=3)),
):
    print(f"{name:26s} device us/call (do_bench median) {1e3 * do_bench(fn, return_mode='median'):.1f}")
