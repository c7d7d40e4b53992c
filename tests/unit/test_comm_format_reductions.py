"""The float-format codecs' fused reductions over received wire rows (``FormatCodec.dequantize_sum``
and ``dequantize_sum_requantize``: the native kernels of ``kernels/cpu_formats.cpp``) against
their specification, the codecs' generic path (``Codec.dequantize_sum``: each source dequantized
and added in fp32, in source order, then rounded or re-encoded) computed by the pure-torch
reference (native kernels off), bit for bit: every element format and MX scale rule of the
registry, k = 1, 2, 4, 7 sources, rows shorter than a block and rows of many partial blocks,
fp32 / bf16 / fp16 sums, nearest and stochastic re-encoding at every width of the scheme, inputs
with zero blocks, subnormals and NaN / Inf blocks, and crafted wire bytes (every code, NaN / Inf /
subnormal / huge scales)."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

from tests.codec_cases import spec_id
from tests.format_reduce_helpers import (
    FORMAT_SPECS,
    KS,
    SHAPES,
    check_case,
    crafted_rows,
    out_widths,
    received,
    reference,
)
from tests.kernel_helpers import assert_same_bits, failing_compiler
from zeropp.comm.codec_base import generic_sum_requantize
from zeropp.comm.codecs import Codec, codec_for
from zeropp.comm.format_codecs import FormatCodec
from zeropp.comm.spec import QuantSpec
from zeropp.kernels import cpu_format_library, cpu_format_wire, cpu_formats, cpu_native


@pytest.fixture(autouse=True)
def native_formats(monkeypatch: pytest.MonkeyPatch):
    """The native kernels on (skip where they cannot be built here)."""
    monkeypatch.setattr(cpu_native, "ENABLED", True)
    if not cpu_formats.available():
        pytest.skip(f"native CPU format kernels unavailable here: {cpu_format_library.FAILED}")


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records each call of the fused kernels' wrappers, so a test knows the fused path ran."""
    calls: list[str] = []
    for name in ("dequantize_sum_wire", "dequantize_sum_requantize_wire"):
        real = getattr(cpu_format_wire, name)

        def spy(*a, _real=real, _name=name, **kw):
            calls.append(_name)
            return _real(*a, **kw)

        monkeypatch.setattr(cpu_format_wire, name, spy)
    return calls


@pytest.mark.parametrize("spec", FORMAT_SPECS, ids=spec_id)
def test_fused_sums_are_the_generic_sums_bit_for_bit(spec: QuantSpec, monkeypatch, fused_calls) -> None:
    codec = codec_for(spec)
    assert isinstance(codec, FormatCodec)
    for rows, cols in SHAPES:
        for k in KS:
            buf = received(codec, spec, k, rows, cols, seed=10 * k + rows)
            check_case(monkeypatch, codec, buf, cols, spec.bits, spec.group_size, out_widths(spec))
    assert "dequantize_sum_wire" in fused_calls and "dequantize_sum_requantize_wire" in fused_calls


@pytest.mark.parametrize("spec", FORMAT_SPECS, ids=spec_id)
def test_fused_sums_of_crafted_wire_bytes_are_the_generic_sums(spec: QuantSpec, monkeypatch) -> None:
    codec = codec_for(spec)
    assert isinstance(codec, FormatCodec)
    for rows, cols in ((1, 7), (5, 257)):
        buf = crafted_rows(codec, spec.bits, 4, rows, cols, spec.group_size, seed=cols)
        check_case(monkeypatch, codec, buf, cols, spec.bits, spec.group_size, out_widths(spec), seeds=(None, 7))


@pytest.mark.parametrize(
    "spec",
    [QuantSpec(scheme="mx", bits=6), QuantSpec(scheme="nvfp4", bits=4), QuantSpec(scheme="fp8", bits=8, group_size=24)],
    ids=spec_id,
)
def test_rows_of_many_tiles_in_strided_buffers(spec: QuantSpec, monkeypatch) -> None:
    """Rows longer than a kernel tile (2048 elements; nvfp4's summed-row buffer), received rows
    read in place from a strided view (every other row of a larger buffer), and ``out=``."""
    codec = codec_for(spec)
    rows, cols, gs = 3, 5000, spec.group_size
    big = received(codec, spec, 3, 2 * rows, cols, seed=1)
    buf = big[:, ::2]  # [3, rows, B], row stride 2 B
    assert not buf.is_contiguous()
    check_case(monkeypatch, codec, buf, cols, spec.bits, gs, out_widths(spec))
    want = reference(monkeypatch, Codec.dequantize_sum, codec, buf.contiguous(), cols, spec.bits, gs)
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.full((rows, cols), 5.0, dtype=dtype)
        assert codec.dequantize_sum(buf, cols, spec.bits, gs, out=out) is out
        assert_same_bits(out, want.to(dtype))


def test_a_failed_build_keeps_the_codec_on_the_generic_path(tmp_path, monkeypatch, fused_calls) -> None:
    """A compiler that really fails (a fresh cache, so the library must be built): the codec warns
    once with the failure, takes the generic path, and returns its results (``out=`` written too)."""
    spec = QuantSpec(scheme="nvfp4", bits=4)
    codec = codec_for(spec)
    buf = received(codec, spec, 2, 3, 100, seed=0)
    want = reference(monkeypatch, Codec.dequantize_sum, codec, buf, 100, 4, 16)
    want2 = reference(monkeypatch, generic_sum_requantize, codec, buf, 100, 4, 16, out_bits=4, seed=3)
    failing_compiler(tmp_path, monkeypatch)
    monkeypatch.setattr(cpu_format_library, "_LIB", None)
    monkeypatch.setattr(cpu_format_library, "FAILED", None)
    monkeypatch.setattr(cpu_format_library, "_warned", False)
    with pytest.warns(RuntimeWarning, match=r"float formats are unavailable \(RuntimeError: .*failed"):
        assert_same_bits(codec.dequantize_sum(buf, 100, 4, 16), want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = torch.empty(3, 100)
        codec.dequantize_sum(buf, 100, 4, 16, out=out)
        assert_same_bits(out, want)
        assert torch.equal(codec.dequantize_sum_requantize(buf, 100, 4, 16, out_bits=4, seed=3), want2)
    assert fused_calls == [] and not list((tmp_path / "cache").rglob("*.so"))


def test_fused_sums_refuse_what_the_generic_path_refuses() -> None:
    codec = codec_for(QuantSpec(scheme="mx", bits=8))
    buf = received(codec, QuantSpec(scheme="mx", bits=8), 2, 2, 64, seed=0)
    with pytest.raises(ValueError, match=r"uint8 \[k, rows, 66\]"):
        codec.dequantize_sum(buf[..., :-1], 64, 8, 32)
    with pytest.raises(ValueError, match="fixed by the format"):
        codec.dequantize_sum_requantize(buf, 64, 8, 16, out_bits=4, seed=None)
    with pytest.raises(ValueError, match="no 5-bit format"):
        codec.dequantize_sum_requantize(buf, 64, 8, 32, out_bits=5, seed=None)
    with pytest.raises(ValueError, match="seed must be an int"):
        codec.dequantize_sum_requantize(buf, 64, 8, 32, out_bits=4, seed=-1)
    with pytest.raises(ValueError, match="out has 126 elements"):
        codec.dequantize_sum(buf, 64, 8, 32, out=torch.empty(2, 63))


@pytest.mark.parametrize("spec", FORMAT_SPECS[:3], ids=spec_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qgz_last_hop_sums_straight_into_the_gradient_shard(
    spec: QuantSpec, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """qgZ's last hop (``qgz._sum_into``): an fp32 shard of a float format (``sums_into``) receives the
    scaled sum directly, with no temporary; a bf16 one goes through the fp32 sum; both equal the
    generic path's sum times the post-scale, rounded once."""
    from zeropp.comm import qgz

    codec = codec_for(spec)
    assert codec.sums_into and not codec.in_place
    n = 257
    buf = received(codec, spec, 3, 1, n, seed=11)  # [3, 1, B]
    want = (reference(monkeypatch, Codec.dequantize_sum, codec, buf, n, spec.bits, spec.group_size) * 0.25).to(dtype)
    outs: list[object] = []
    real = FormatCodec.dequantize_sum

    def spy(self, *a, **kw):
        outs.append(kw.get("out"))
        return real(self, *a, **kw)

    monkeypatch.setattr(FormatCodec, "dequantize_sum", spy)
    out = torch.full((n,), float("nan"), dtype=dtype)
    qgz._sum_into(codec, buf, n, spec.bits, spec.group_size, 0.25, out)
    assert_same_bits(out, want.view(-1))
    assert (outs == [out]) if dtype == torch.float32 else (outs == [None])


def test_a_strided_out_gets_the_same_sum(monkeypatch: pytest.MonkeyPatch) -> None:
    """``dequantize_sum(out=)`` into columns of a larger buffer (not contiguous): the same values as
    the generic sum, on the native path too (which writes contiguous rows, so it goes generic)."""
    spec = FORMAT_SPECS[0]
    codec = codec_for(spec)
    buf = received(codec, spec, 2, 3, 50, seed=5)  # [2, 3, B]
    want = reference(monkeypatch, Codec.dequantize_sum, codec, buf, 50, spec.bits, spec.group_size)
    big = torch.full((3, 80), 7.0)
    codec.dequantize_sum(buf, 50, spec.bits, spec.group_size, out=big[:, 10:60])
    assert_same_bits(big[:, 10:60], want)
    assert torch.all(big[:, :10] == 7.0) and torch.all(big[:, 60:] == 7.0)


WIRE_NAMES = ("encode_wire", "dequantize_sum_wire", "dequantize_sum_requantize_wire")


def test_the_wire_operations_are_still_read_from_cpu_formats(monkeypatch) -> None:
    """They moved to ``cpu_format_wire``; ``zeropp.kernels.cpu_formats.encode_wire`` (and the fused
    sums) stay where users import them, as the same functions, with no import cycle
    (``test_imports``): a fresh interpreter imports them from the old module first. ``FAILED`` is
    read where the library records it."""
    for name in WIRE_NAMES:
        assert getattr(cpu_formats, name) is getattr(cpu_format_wire, name), name
    monkeypatch.setattr(cpu_format_library, "FAILED", "RuntimeError: no C++ compiler found")
    assert cpu_formats.FAILED == "RuntimeError: no C++ compiler found"
    with pytest.raises(AttributeError, match="has no attribute 'no_such_op'"):
        cpu_formats.no_such_op  # noqa: B018
    code = f"from zeropp.kernels.cpu_formats import {', '.join(WIRE_NAMES)}; print(encode_wire.__module__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout) == (0, "zeropp.kernels.cpu_format_wire\n"), out.stderr
