"""Properties of the quantization format through the public API (torch reference, the spec), its input
checks, the CPU dispatch, and a smoke run of the kernel benchmark.

Here: the end-to-end checks. The topic's full description and its one-process checks are in
``tests/unit/test_kernels.py``.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from tests.kernel_helpers import (
    COMPILED_SHAPES,
    DTYPES,
    assert_bit_identical,
    assert_same_bits,
    awkward,
    compiled_path,  # noqa: F401  (a fixture, used by name)
    gaussian,
    stack,
)
from zeropp.kernels import QuantizedTensor, quantize

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_every_implementation_takes_the_largest_block_and_refuses_a_larger_one_alike():
    """One bound on the block size for the torch reference, the CPU path, the Triton launchers
    (their tile config too), a QuantizedTensor and the QuantSpec a config builds: a group size
    that works on CPU works on a GPU, and one that is too large fails everywhere with one message
    naming the largest allowed. The largest itself quantizes the same bits on every path."""
    from zeropp.comm.spec import MAX_GROUP_SIZE as SPEC_MAX
    from zeropp.comm.spec import QuantSpec
    from zeropp.kernels._triton import HAS_TRITON, TileConfig
    from zeropp.kernels.cpu import quantize_cpu
    from zeropp.kernels.layout import MAX_GROUP_SIZE
    from zeropp.kernels.reference import quantize_ref

    assert MAX_GROUP_SIZE == SPEC_MAX == 1 << 14
    x = gaussian(2 * MAX_GROUP_SIZE + 5)
    big = MAX_GROUP_SIZE + 2  # even: only the size is wrong
    q = quantize_ref(x, 8, 64)
    calls = [
        lambda: quantize_ref(x, 8, big),
        lambda: quantize_cpu(x, 4, big),
        lambda: quantize(x, 8, big),
        lambda: QuantizedTensor(q.codes, q.scales, q.cols, 8, big),
    ]
    if HAS_TRITON:  # the tile config needs no interpreter; a CPU launch does
        calls += [lambda: TileConfig(big, 1)] + (
            [lambda: quantize(x, 8, big, impl="triton")] if os.environ.get("TRITON_INTERPRET") == "1" else []
        )
    messages = set()
    for call in calls:
        with pytest.raises(ValueError) as info:
            call()
        messages.add(str(info.value))
    assert len(messages) == 1, messages
    assert f"group_size={big} is larger than the quantization kernels' largest block" in messages.pop()
    with pytest.raises(ValueError, match=f"group_size <= {MAX_GROUP_SIZE}"):
        QuantSpec(bits=8, group_size=big)
    for bits in (8, 4):
        ref = quantize_ref(x, bits, MAX_GROUP_SIZE, stochastic=True, seed=3)
        got = quantize_cpu(x, bits, MAX_GROUP_SIZE, stochastic=True, seed=3)
        assert torch.equal(got.codes, ref.codes) and torch.equal(got.scales, ref.scales)
    assert QuantSpec(bits=4, group_size=MAX_GROUP_SIZE).group_size == MAX_GROUP_SIZE


# ---------------------------------------------------------------------------------------------
# The compiled CPU kernels (kernels/cpu_fused.py) against the reference, bit for bit. Each
# (op, dtype, bits, group size, k) variant compiles once per process, so the matrix is kept small:
# every dtype and bit width at one group size, the rest on fp32.
# ---------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("compiled_path")
@pytest.mark.parametrize(
    "dtype,bits,group_size,stochastic",
    [(d, b, 100, False) for d in DTYPES for b in (8, 4)]
    + [(torch.float32, b, gs, False) for b in (8, 4) for gs in (2, 512)]
    + [(torch.float32, b, 100, True) for b in (8, 4)],
    ids=str,
)
def test_compiled_cpu_quantize_is_bit_identical_to_the_reference(dtype, bits, group_size, stochastic):
    from zeropp.kernels.cpu import quantize_cpu
    from zeropp.kernels.reference import quantize_ref

    for shape, rows in COMPILED_SHAPES:
        x = awkward(shape, dtype, seed=rows)
        ref = quantize_ref(x, bits, group_size, rows=rows, stochastic=stochastic, seed=9)
        assert_bit_identical(quantize_cpu(x, bits, group_size, rows=rows, stochastic=stochastic, seed=9), ref)
    t = awkward((700, 34), dtype).t()  # non-contiguous input
    assert_bit_identical(quantize_cpu(t, bits, group_size, rows=34), quantize_ref(t, bits, group_size, rows=34))


@pytest.mark.usefixtures("compiled_path")
@pytest.mark.parametrize("bits", [8, 4])
def test_compiled_cpu_dequantize_and_sums_are_bit_identical_to_the_reference(bits):
    from zeropp.kernels.cpu import dequantize_cpu, dequantize_sum_cpu
    from zeropp.kernels.reference import dequantize_ref, dequantize_sum_ref

    for shape, rows in COMPILED_SHAPES:
        qs = [quantize(awkward(shape, torch.float32, seed=i), bits, 100, rows=rows) for i in range(3)]
        for dtype in DTYPES:
            assert_same_bits(dequantize_cpu(qs[0], dtype=dtype), dequantize_ref(qs[0], dtype=dtype))
            s = stack(qs)
            assert_same_bits(dequantize_sum_cpu(s, dtype=dtype), dequantize_sum_ref(s, dtype=dtype))
        out = torch.full((math.prod(shape),), 7.0, dtype=torch.bfloat16)
        assert dequantize_cpu(qs[1], out=out) is out
        assert_same_bits(out, dequantize_ref(qs[1], dtype=torch.bfloat16).view(-1))
        one = stack(qs[:1])
        assert_same_bits(dequantize_sum_cpu(one), dequantize_sum_ref(one))


@pytest.mark.usefixtures("compiled_path")
@pytest.mark.parametrize("in_bits,out_bits", [(8, 4), (4, 8), (4, 4)])
@pytest.mark.parametrize("stochastic", [False, True])
def test_compiled_cpu_requantize_is_bit_identical_to_the_reference(in_bits, out_bits, stochastic):
    from zeropp.kernels.cpu import dequantize_sum_requantize_cpu
    from zeropp.kernels.reference import dequantize_sum_requantize_ref

    for shape, rows in COMPILED_SHAPES[2:]:
        qs = [quantize(awkward(shape, torch.float32, seed=i), in_bits, 100, rows=rows) for i in range(3)]
        s = stack(qs)
        want = dequantize_sum_requantize_ref(s, out_bits, 100, stochastic=stochastic, seed=4)
        assert_bit_identical(dequantize_sum_requantize_cpu(s, out_bits, 100, stochastic=stochastic, seed=4), want)


@pytest.mark.usefixtures("compiled_path")
@pytest.mark.parametrize("group_size", [2, 100])
def test_compiled_cpu_int4_codes_at_odd_offsets(group_size):
    """INT4 codes read as int16 pairs only where their bytes allow it (even offset and length);
    codes in a receive buffer at an odd offset, or one byte per block, take the byte-wise unpack."""
    from zeropp.kernels.cpu import dequantize_cpu, dequantize_sum_cpu
    from zeropp.kernels.reference import dequantize_ref, dequantize_sum_ref

    q = quantize(awkward((4, 1000), torch.float32), 4, group_size, rows=4)
    buf = torch.empty(1 + q.codes.numel(), dtype=torch.uint8)
    buf[1:] = q.codes.view(-1)
    odd = QuantizedTensor(buf[1:].view(q.codes.shape), q.scales, q.cols, 4, group_size)
    assert odd.codes.storage_offset() == 1
    assert_same_bits(dequantize_cpu(odd), dequantize_ref(q))
    assert_same_bits(dequantize_sum_cpu(stack([odd, odd])), dequantize_sum_ref(stack([q, q])))


@pytest.mark.usefixtures("compiled_path")
def test_compiled_cpu_kernels_are_reused_across_sizes_and_kept_apart_across_variants():
    """One compiled kernel per variant serves every bucket size (no recompiling per shape), and
    variants that share the Python formulation never answer for each other."""
    from zeropp.kernels import cpu_fused
    from zeropp.kernels.cpu import dequantize_cpu, quantize_cpu
    from zeropp.kernels.reference import dequantize_ref, quantize_ref

    calls = [
        (n, dtype, bits, gs)
        for n in (1000, 64 * 1000, 3000, 1000)
        for dtype in (torch.float32, torch.bfloat16)
        for bits, gs in ((8, 100), (4, 100), (8, 500))
    ]
    for n, dtype, bits, gs in calls:
        x = awkward((n,), dtype, seed=n)
        q = quantize_cpu(x, bits, gs)
        assert_bit_identical(q, quantize_ref(x, bits, gs))
        assert_same_bits(dequantize_cpu(q, dtype=dtype), dequantize_ref(q, dtype=dtype))
    keys = {k for k in cpu_fused._COMPILED if k[0] in ("q", "dq") and k[1] in (torch.float32, torch.bfloat16)}
    assert {("q", d, b, gs, False) for _, d, b, gs in calls} <= keys
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= len(cpu_fused._COMPILED) * 2  # static/dynamic


def test_native_cpu_build_is_cached_and_keyed(tmp_path, monkeypatch):
    """A second build of the same source and flags is the cached library; other flags (or another
    CPU, compiler or source) get their own file, never a library built for something else."""
    from zeropp.kernels import cpu_native

    if not cpu_native.available():
        pytest.skip(f"native CPU kernels unavailable here: {cpu_native.FAILED}")
    monkeypatch.setenv("ZEROPP_CACHE_DIR", str(tmp_path))
    first = cpu_native._build()
    mtime = first.stat().st_mtime_ns
    assert cpu_native._build() == first and first.stat().st_mtime_ns == mtime
    # other flags (-O0 last: the variant compiles in a fraction of -O3's time; any flag keys alike)
    monkeypatch.setattr(cpu_native, "FLAGS", [*cpu_native.FLAGS, "-DZQ_TEST_VARIANT", "-O0"])
    assert cpu_native._build() != first
    names = sorted(p.name for p in (tmp_path / "cpu_native").iterdir())  # each library, its hash, its lock
    assert [n.split(".", 1)[1] for n in names] == ["so", "so.lock", "so.sha256"] * 2, names  # no temporaries left


# ---------------------------------------------------------------------------------------------
# Benchmark smoke test (CPU, tiny sizes; no timing assertions)
# ---------------------------------------------------------------------------------------------
def test_bench_runs_on_cpu(capsys):
    from zeropp.experiments.bench import format_rows
    from zeropp.experiments.bench import kernels as bench_kernels

    rows = bench_kernels.main(["--device", "cpu", "--max-mib", "0.125", "--iters", "2", "--warmup", "1"])
    text = capsys.readouterr().out
    assert (
        "CPU: timing the CPU path (kernels/cpu.py, bit-identical to the torch reference), not the Triton kernels"
        in text
    )
    assert {r["op"] for r in rows} >= {"copy", "quantize int8 g512", "fused reduce int4 g128 k4"}
    labels = [label for label, *_, stochastic in format_rows.CASES.values() if not stochastic]
    assert {f"{kind} {label}" for kind in ("quantize", "dequantize") for label in labels} <= {r["op"] for r in rows}
    assert "share of copy bandwidth as a fraction of the INT8 op's" in text
    assert all(r["bytes"] > 0 and r["gbps"] > 0 for r in rows)
    # each op also timed through the tiled path, in the same run: speed-up and old share of copy
    assert "x old" in text and "old of copy" in text
    # the float formats' fused reductions are timed against their generic path instead, in pairs
    paired = {r["op"] for r in rows if r.get("vs_generic") is not None or r["op"].endswith(" generic")}
    assert paired and all(r["vs_old"] is None for r in rows if r["op"] in paired)
    assert all(r["vs_old"] > 0 and r["old_fraction"] > 0 for r in rows if r["op"] != "copy" and r["op"] not in paired)
