"""The float formats' rows of ``experiments.bench_kernels`` (``experiments/bench/format_rows.py``):
which rows, their byte counts (full-precision data plus the exact wire bytes), that the timed
calls run the format they are labelled with, and when they are on."""

from __future__ import annotations

import torch

from zeropp.experiments.bench import format_rows as bench_format_rows
from zeropp.experiments.bench import kernels as bench_kernels
from zeropp.kernels import format_ops
from zeropp.kernels.format_layout import FormatTensor, wire_bytes


def test_rows_count_input_and_wire_bytes_and_time_the_labelled_format():
    x = torch.randn(1000, dtype=torch.bfloat16)
    rows: list[tuple[str, int, int, object]] = []
    bench_format_rows.record_formats(lambda op, size, nbytes, fn: rows.append((op, size, nbytes, fn())), x, 2000)
    want_ops = []
    for label, *_, stochastic in bench_format_rows.CASES:
        want_ops.append(f"quantize {label}")
        want_ops += [] if stochastic else [f"dequantize {label}"]
    assert [r[0] for r in rows] == want_ops
    by_op = {op: (size, nbytes, result) for op, size, nbytes, result in rows}
    for label, scheme, elem, gs, stochastic in bench_format_rows.CASES:
        size, nbytes, q = by_op[f"quantize {label}"]
        assert size == 2000 and nbytes == 2 * 1000 + wire_bytes(scheme, elem, 1000, gs)
        assert isinstance(q, FormatTensor) and (q.scheme, q.elem, q.group_size) == (scheme, elem, gs)
        if not stochastic:
            _, nbytes, out = by_op[f"dequantize {label}"]
            assert nbytes == 2 * 1000 + wire_bytes(scheme, elem, 1000, gs)
            assert torch.equal(out, format_ops.dequantize_format(q, dtype=torch.bfloat16).view(-1))


def test_formats_rows_are_on_for_cuda_by_default_and_on_request():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert bench_format_rows.wanted("auto", cuda) and not bench_format_rows.wanted("auto", cpu)
    assert bench_format_rows.wanted("yes", cpu) and not bench_format_rows.wanted("no", cuda)
    assert bench_kernels.parse_args(["--device", "cpu"]).formats == "auto"
    assert bench_kernels.parse_args(["--device", "cpu", "--formats", "yes"]).formats == "yes"
