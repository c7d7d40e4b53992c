"""The quantized collectives make no copies around the collective itself.

What is proven, and how:

- parity: the ``int`` codec's in-place wire path (quantize into views of the send buffer, read
  the receive buffer through views) produces the same bytes and the same values as the generic
  pack / unpack path (``Codec``'s defaults, which are what the codec did before), on awkward
  sizes (1, 7, 17x257), fp32/bf16/fp16, INT8/INT4, round-to-nearest and stochastic, and on group
  sizes whose layout cannot be viewed in place (those keep copying, with the same bytes);
- aliasing: ``unpack`` returns views of the received buffer; the all-gather writes the caller's
  output (same ``data_ptr``), also when the output is a row-strided column slice;
- op counts: a ``TorchDispatchMode`` records every aten op the caller's thread issues during a
  quantized all-gather / reduce-scatter on gloo worlds of 2 and 2x2 ranks, with the kernels
  forced onto the Triton path (run by the interpreter on CPU). Ops issued *inside* a kernel
  launch are not counted: the interpreter emulates the kernel with host copies of its
  arguments, a GPU launch issues no aten op at all. What remains must be exactly the send and
  receive wire buffers (one allocation each, codes and scales included), the collective, and
  views: no ``copy_``, ``cat``, ``clone`` or ``contiguous`` copy, in particular no swizzled copy
  of the gradient in the hierarchical qgZ.

Here: the gloo-world checks of this topic; its other tiers' checks are in
``tests/unit/test_comm_zero_copy.py``, ``tests/gpu/test_comm_zero_copy.py``.
"""

from __future__ import annotations

import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.kernel_helpers import DTYPES
from tests.triton_helpers import interpreted
from tests.worlds import run_world
from zeropp.comm.codecs import wire_layout

ALLOC_OPS = ("empty", "empty_like", "zeros", "zeros_like", "new_empty", "new_zeros", "empty_strided")
COPY_OPS = ("copy_", "cat", "clone", "_to_copy", "index_select", "stack", "contiguous")


# ----------------------------------------------------------------------------------------------
# Op counting on gloo worlds, kernels forced onto the Triton path
# ----------------------------------------------------------------------------------------------
class OpLog(TorchDispatchMode):
    """Every aten op of this thread with the bytes of its first tensor result, except inside a
    kernel launch (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, int]] = []
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            t = (
                out
                if isinstance(out, torch.Tensor)
                else next(
                    (o for o in (out if isinstance(out, (tuple, list)) else ()) if isinstance(o, torch.Tensor)), None
                )
            )
            self.ops.append((func.overloadpacket.__name__, 0 if t is None else t.numel() * t.element_size()))
        return out

    def names(self, kinds) -> list[tuple[str, int]]:
        return [(n, b) for n, b in self.ops if n in kinds]


def _force_triton(log: OpLog) -> None:
    """Route every kernel call to the Triton launchers and keep their launches out of ``log``."""
    kq, kr = sys.modules["zeropp.kernels.quantize"], sys.modules["zeropp.kernels.reduce"]
    kq._use_triton = kr._use_triton = lambda t, impl: True
    from zeropp.kernels import _triton

    launch = _triton.LaunchPlan.__call__

    def paused(self, *a, **k):
        log.paused += 1
        try:
            return launch(self, *a, **k)
        finally:
            log.paused -= 1

    _triton.LaunchPlan.__call__ = paused


def _pause_in_cpu_kernels(log: OpLog) -> None:
    """Keep the CPU kernels' own work (``kernels/cpu.py``: outputs, tile scratch) out of ``log``."""
    for mod in (sys.modules["zeropp.kernels.quantize"], sys.modules["zeropp.kernels.reduce"]):
        for name in ("quantize_cpu", "dequantize_cpu", "dequantize_sum_cpu", "dequantize_sum_requantize_cpu"):
            fn = getattr(mod, name, None)
            if fn is None:
                continue

            def paused(*a, _fn=fn, **k):
                log.paused += 1
                try:
                    return _fn(*a, **k)
                finally:
                    log.paused -= 1

            setattr(mod, name, paused)


def _zero_copy_world(rank: int, W: int, nodes: int, triton: bool = True) -> dict:
    import torch.distributed as dist

    from zeropp.comm import QuantSpec, Topology, quantized_all_gather, quantized_reduce_scatter

    log = OpLog()
    _force_triton(log) if triton else _pause_in_cpu_kernels(log)
    topo = Topology.from_world(W, W // nodes)
    gen = torch.Generator().manual_seed(rank)
    res: dict = {}
    n = 17 * 257
    # all-gather into a bf16 output; then into columns of a wider buffer (the engine's buckets)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(n, generator=gen).to(dtype)
        out = torch.empty(W * n, dtype=dtype)
        ptr = out.data_ptr()
        spec = QuantSpec(bits=8, group_size=128)
        quantized_all_gather(out, x, spec=spec, topology=topo)  # warm-up: plans built, compiled
        log.ops.clear()
        with log:
            quantized_all_gather(out, x, spec=spec, topology=topo)
        B = wire_layout(n, 8, 128).nbytes
        res[f"ag_{dtype}"] = dict(
            allocs=log.names(ALLOC_OPS),
            copies=log.names(COPY_OPS),
            B=B,
            full=out.nbytes,
            same_ptr=out.data_ptr() == ptr,
            collectives=[o for o, _ in log.ops if "gather" in o],
        )
        ref = torch.empty(W * n, dtype=dtype)
        quantized_all_gather(ref, x, spec=spec, topology=topo)
        res[f"ag_{dtype}_equal"] = torch.equal(out, ref)
    wide = torch.full((W, n + 40), 5.0)
    with log:
        log.ops.clear()
        quantized_all_gather(
            wide[:, 20 : 20 + n], torch.randn(n, generator=gen), spec=QuantSpec(bits=4, group_size=128), topology=topo
        )
    res["ag_cols"] = dict(
        copies=log.names(COPY_OPS), untouched=bool((wide[:, :20] == 5).all() and (wide[:, 20 + n :] == 5).all())
    )
    # reduce-scatter of fp32 gradients: single hop (one node) or hierarchical qgZ (2x2)
    for bits, intra in ((4, None), (8, 4)):
        g = torch.randn(W * n, generator=gen)
        o = torch.empty(n)
        spec = QuantSpec(bits=bits, intra_bits=intra, group_size=128)
        quantized_reduce_scatter(o, g, spec=spec, topology=topo)
        log.ops.clear()
        with log:
            quantized_reduce_scatter(o, g, spec=spec, topology=topo)
        res[f"rs_{bits}_{intra}"] = dict(
            allocs=log.names(ALLOC_OPS),
            copies=log.names(COPY_OPS),
            full=g.nbytes,
            B=wire_layout(n, intra or bits, 128).nbytes,
        )
    dist.barrier()
    return res


def _check_world(results: list[dict], W: int, hierarchical: bool) -> None:
    for res in results:
        for dtype in (torch.bfloat16, torch.float32):
            ag = res[f"ag_{dtype}"]
            assert ag["copies"] == [], ag["copies"]  # no pack (cat), no unpack (contiguous), no temp -> out copy
            assert sorted(b for _, b in ag["allocs"]) == [ag["B"], W * ag["B"]]  # send row and receive buffer only
            assert ag["same_ptr"] and res[f"ag_{dtype}_equal"]
            assert len(ag["collectives"]) == 1  # one message: codes and scales together
        assert res["ag_cols"]["copies"] == [] and res["ag_cols"]["untouched"]
        for key in ("rs_4_None", "rs_8_4"):
            rs = res[key]
            assert rs["copies"] == [], (key, rs["copies"])  # in particular no swizzled copy of the gradient
            # hop 1's send and receive buffers: W wire rows each (hop 2 runs on the comm thread)
            assert sorted(b for _, b in rs["allocs"]) == [W * rs["B"], W * rs["B"]], (key, rs["allocs"])


def _check_cpu_path(results: list[dict], W: int) -> None:
    """The CPU kernels (``kernels/cpu.py``) write codes and scales into the send buffer through
    ``out=``; this bound is the looser one from before they did (the only copies around the
    collective at most the send buffer's size of quantized bytes), and the only allocations the
    send and receive buffers. No pack ``cat``, no unpack copy, no
    full-precision temporary."""
    for res in results:
        for key, rec in res.items():
            if not isinstance(rec, dict) or "allocs" not in rec:
                continue
            send = rec["B"] * (1 if key.startswith("ag") else W)
            assert {o for o, _ in rec["copies"]} <= {"copy_"}, (key, rec["copies"])
            assert sum(b for _, b in rec["copies"]) <= send, (key, rec["copies"])
            assert sorted(b for _, b in rec["allocs"]) == sorted([send, W * rec["B"]]), (key, rec["allocs"])


def test_cpu_path_makes_no_full_size_copies_world_2() -> None:
    _check_cpu_path(run_world(_zero_copy_world, 2, 1, False, timeout=300.0), 2)


@interpreted
def test_no_copies_around_collectives_world_2() -> None:
    _check_world(run_world(_zero_copy_world, 2, 1, timeout=300.0), 2, False)


@interpreted
def test_no_copies_around_hierarchical_qgz_2x2() -> None:
    _check_world(run_world(_zero_copy_world, 4, 2, timeout=300.0), 4, True)


# ----------------------------------------------------------------------------------------------
# The engine's bucketed collectives: quantized chunks read and write columns of the caller's
# buffers in place, with the results of the old path (contiguous temporary + copy)
# ----------------------------------------------------------------------------------------------
def _engine_buckets(rank: int, W: int) -> dict:
    from zeropp.comm import QuantSpec, Topology, quantized_all_gather, quantized_reduce_scatter
    from zeropp.comm.stats import CommStats
    from zeropp.runtime.collectives import EngineComm
    from zeropp.runtime.plan_kinds import chunk_ranges

    topo = Topology.single_node(W)
    comm = EngineComm(topo, CommStats())
    gen = torch.Generator().manual_seed(10 + rank)
    S, bucket = 17 * 257, 2 * 1000  # 5 column chunks of <= 1000 per rank
    res: dict = {}
    for dtype in DTYPES:
        spec = QuantSpec(bits=4, group_size=128)
        shard = torch.randn(S, generator=gen).to(dtype)
        out = torch.empty(W * S, dtype=dtype)
        ptr = out.data_ptr()
        comm.all_gather(out, shard, spec=spec, bucket=bucket, kind="ag", async_op=False)
        old = torch.empty(W * S, dtype=dtype)  # the old path: each chunk through a contiguous temporary
        for a, b in chunk_ranges(S, W, bucket):
            tmp = torch.empty(W * (b - a), dtype=dtype)
            quantized_all_gather(tmp, shard[a:b], spec=spec, topology=topo)
            old.view(W, S)[:, a:b].copy_(tmp.view(W, b - a))
        res[f"ag_{dtype}"] = (out.data_ptr() == ptr, torch.equal(out, old), len(chunk_ranges(S, W, bucket)))

        full = torch.randn(W * S, generator=gen).to(dtype)
        before = full.clone()
        red = torch.empty(S, dtype=dtype)
        comm.reduce_scatter(
            red, full, spec=QuantSpec(bits=8, intra_bits=4, group_size=128), bucket=bucket, kind="rs", async_op=False
        )
        old_red = torch.empty(S, dtype=dtype)
        for a, b in chunk_ranges(S, W, bucket):  # the old path: a contiguous copy of each chunk's columns
            quantized_reduce_scatter(
                old_red[a:b],
                full.view(W, S)[:, a:b].contiguous(),
                torch.distributed.ReduceOp.AVG,
                spec=QuantSpec(bits=8, intra_bits=4, group_size=128),
                topology=topo,
            )
        res[f"rs_{dtype}"] = (torch.equal(red, old_red), torch.equal(full, before))
    return res


def test_engine_bucketed_collectives_write_in_place_world_2() -> None:
    for res in run_world(_engine_buckets, 2, timeout=300.0):
        for key, value in res.items():
            assert all(v for v in value if isinstance(v, bool)), (key, value)
            if key.startswith("ag"):
                assert value[2] > 1  # the buckets really split the gather
