"""The float formats' rows of ``experiments.bench_kernels`` (``experiments/bench/format_rows.py``):
which rows, their byte counts (full-precision data plus the exact wire bytes), that the timed
calls run the format they are labelled with, and when they are on."""

from __future__ import annotations

import pytest
import torch

from zeropp.experiments.bench import format_rows as bench_format_rows
from zeropp.experiments.bench import kernels as bench_kernels
from zeropp.kernels import format_ops
from zeropp.kernels.format_layout import FormatTensor, wire_bytes


def test_rows_count_input_and_wire_bytes_and_time_the_labelled_format():
    x = torch.randn(1000, dtype=torch.bfloat16)
    rows: list[tuple[str, int, int, object]] = []
    bench_format_rows.record_formats(
        lambda op, size, nbytes, fn: rows.append((op, size, nbytes, fn())), x, 2000, list(bench_format_rows.CASES)
    )
    want_ops = []
    for label, *_, stochastic in bench_format_rows.CASES.values():
        want_ops.append(f"quantize {label}")
        want_ops += [] if stochastic else [f"dequantize {label}"]
    assert [r[0] for r in rows] == want_ops
    by_op = {op: (size, nbytes, result) for op, size, nbytes, result in rows}
    for label, scheme, elem, gs, stochastic in bench_format_rows.CASES.values():
        size, nbytes, q = by_op[f"quantize {label}"]
        assert size == 2000 and nbytes == 2 * 1000 + wire_bytes(scheme, elem, 1000, gs)
        assert isinstance(q, FormatTensor) and (q.scheme, q.elem, q.group_size) == (scheme, elem, gs)
        if not stochastic:
            _, nbytes, out = by_op[f"dequantize {label}"]
            assert nbytes == 2 * 1000 + wire_bytes(scheme, elem, 1000, gs)
            assert torch.equal(out, format_ops.dequantize_format(q, dtype=torch.bfloat16).view(-1))


def test_formats_option_takes_all_none_or_names(capsys):
    assert bench_kernels.parse_args(["--device", "cpu"]).formats == list(bench_format_rows.CASES)
    assert bench_kernels.parse_args(["--formats", "none"]).formats == []
    assert bench_kernels.parse_args(["--formats", "mxfp4,nvfp4"]).formats == ["mxfp4", "nvfp4"]
    with pytest.raises(SystemExit) as e:
        bench_kernels.parse_args(["--formats", "mxfp4,fp5"])
    assert e.value.code == 2 and "unknown format(s) fp5" in capsys.readouterr().err


def test_each_format_is_compared_with_the_int8_op_of_its_kind_and_size():
    rows = [
        {"op": "quantize int8 g512", "size": 1024, "fraction": 0.40},
        {"op": "dequantize int8 g512", "size": 1024, "fraction": 0.80},
        {"op": "quantize mxfp4", "size": 1024, "fraction": 0.10},
        {"op": "dequantize nvfp4", "size": 1024, "fraction": 0.60},
        {"op": "quantize nvfp4", "size": 4096, "fraction": 0.30},  # no INT8 row of that size
        {"op": "quantize int4 g128", "size": 1024, "fraction": 0.20},  # not a float format
    ]
    assert bench_format_rows.format_shares(rows) == [
        ("quantize mxfp4", 1024, 0.10, pytest.approx(0.25)),
        ("dequantize nvfp4", 1024, 0.60, pytest.approx(0.75)),
    ]
    text = bench_format_rows.shares_text(rows, lambda b: f"{b} B")
    assert text.startswith("float formats at 1024 B") and "quantize mxfp4" in text
    assert text.count("below target") == 1  # mxfp4's 25% of INT8's; nvfp4's 75% meets the target


def test_reduction_rows_time_the_fused_and_the_generic_call_of_the_labelled_codec():
    """Each case gives a fused row (with its speed-up) and a generic row of the same bytes; the two
    timed calls return the same wire rows / sums (they are the same reduction), in the labelled
    format, and the summary lists the fused rows."""
    from zeropp.kernels import cpu_formats

    if not cpu_formats.native_enabled():
        pytest.skip("the native CPU kernels of the formats cannot be built here")
    x = torch.randn(1000, dtype=torch.bfloat16)
    rows: list[dict] = []
    results: dict[str, tuple[object, object]] = {}

    def pair(fused, generic):
        results[f"call{len(results)}"] = (fused(), generic())
        return 1.0, 3.0, 3.0

    def record(op, size, nbytes, fn, *, seconds=None, **extra):
        assert fn is None and seconds is not None
        rows.append(dict(op=op, size=size, bytes=nbytes, seconds=seconds, fraction=0.5, **extra))

    bench_format_rows.record_reductions(record, pair, x, 2000, ["mxfp6", "mxint8", "mxfp4_sr", "nvfp4"], 3)
    ops = [r["op"] for r in rows]
    assert ops[:4] == [
        "fused reduce mxfp6 e3m2 k3",
        "fused reduce mxfp6 e3m2 k3 generic",
        "dequantize_sum mxfp6 e3m2 k3",
        "dequantize_sum mxfp6 e3m2 k3 generic",
    ]
    assert "dequantize_sum mxfp4 stochastic k3" not in ops and "fused reduce mxfp4 stochastic k3" in ops
    wb = {"mxfp6 e3m2": wire_bytes("mx", "e3m2", 1000, 32), "nvfp4": wire_bytes("nvfp4", "e2m1", 1000, 16)}
    by_op = {r["op"]: r for r in rows}
    for label, b in wb.items():
        assert by_op[f"fused reduce {label} k3"]["bytes"] == by_op[f"fused reduce {label} k3 generic"]["bytes"] == 4 * b
        assert by_op[f"dequantize_sum {label} k3"]["bytes"] == 3 * b + 2 * 1000
        assert by_op[f"dequantize_sum {label} k3"]["vs_generic"] == 3.0
    for fused, generic in results.values():
        assert fused.dtype == generic.dtype and fused.shape == generic.shape
        assert torch.equal(torch.nan_to_num(fused.float()), torch.nan_to_num(generic.float()))
    sums = [fused for fused, _ in results.values() if fused.dtype == torch.bfloat16]
    assert len(sums) == 3 and all(s.shape == (1, 1000) for s in sums)
    text = bench_format_rows.fused_text(rows, lambda b: f"{b} B")
    assert text.count("3.00x generic") == 7 and "generic generic" not in text


def test_no_reduction_rows_where_no_fused_kernel_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the native CPU kernels off (``--cpu-path compiled`` / ``tiled``) a "fused" row would time
    the generic path against itself: none is recorded."""
    from zeropp.kernels import cpu_native

    monkeypatch.setattr(cpu_native, "ENABLED", False)
    rows: list[dict] = []
    bench_format_rows.record_reductions(
        lambda *a, **kw: rows.append(a), lambda f, g: (1.0, 1.0, 1.0), torch.randn(100), 200, ["mxfp4", "nvfp4"], 2
    )
    assert rows == []
