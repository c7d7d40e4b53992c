"""Shared pieces of the tests of the float formats' fused reductions over received wire rows
(``FormatCodec.dequantize_sum`` / ``dequantize_sum_requantize``, native CPU and Triton): the
formats, received rows of awkward inputs and of crafted bytes, and the comparison with the
specification, the codecs' generic path computed by the pure-torch reference."""

from __future__ import annotations

from typing import Callable, Optional

import pytest
import torch

from tests.codec_cases import format_variants, registry_specs
from tests.format_kernel_helpers import format_inputs, useful_huge
from tests.kernel_helpers import DTYPES, assert_same_bits
from zeropp.comm.codec_base import generic_sum_requantize
from zeropp.comm.codecs import Codec
from zeropp.comm.format_codecs import FORMAT_SCHEMES, FormatCodec
from zeropp.comm.spec import QuantSpec, schemes
from zeropp.kernels import cpu_native

FORMAT_SPECS = [s for s in registry_specs(group_size=100) if s.scheme in FORMAT_SCHEMES] + format_variants()
"""Every element format of every float scheme (fp8 with a group size that is not a power of two)
and both MX scale rules."""

SHAPES = [(1, 1), (1, 7), (17, 257)]
"""(rows, cols): shorter than any block, one partial block, many rows of partial last blocks."""

KS = (1, 2, 4, 7)


def reference(monkeypatch: pytest.MonkeyPatch, fn, *args, **kw):
    """``fn(*args, **kw)`` with the native kernels off: every dequantize and encode the generic
    path makes runs the pure-torch reference (``format_reference.py``)."""
    with monkeypatch.context() as m:
        m.setattr(cpu_native, "ENABLED", False)
        return fn(*args, **kw)


def received(codec: Codec, spec: QuantSpec, k: int, rows: int, cols: int, seed: int) -> torch.Tensor:
    """k sources' wire rows ``uint8 [k, rows, B]`` of awkward inputs (zero / -0.0 blocks,
    subnormals, NaN and Inf blocks, values beyond the formats' range), one seed each."""
    huge = useful_huge(spec.scheme, rows)
    xs = [format_inputs((rows, cols), torch.float32, seed=seed + j, huge=huge) for j in range(k)]
    return torch.stack([codec.encode(x, spec.bits, spec.group_size, rows=rows, seed=None) for x in xs])


def crafted_rows(codec: FormatCodec, bits: int, k: int, rows: int, cols: int, gs: int, seed: int) -> torch.Tensor:
    """Random wire bytes ``uint8 [k, rows, B]``: every code (E4M3 / E5M2 NaN and Inf codes too) and
    random scale bit patterns, with the special scales forced into source 0's first row: fp8 NaN,
    Inf, a subnormal and 0; mx E8M0 255 (NaN block), 0 (2^-127) and 254; nvfp4 E4M3 0x7F (NaN)
    and 0, and tensor scales 0, subnormal and huge in later rows."""
    gen = torch.Generator().manual_seed(seed)
    B = codec.wire_bytes(cols, bits, gs)
    buf = torch.randint(0, 256, (k, rows, B), generator=gen, dtype=torch.uint8)
    q = codec.unpack(buf[0], cols, bits, gs)
    cb, g = q.codes.shape[-1], q.scales.shape[-1]
    if codec.kernel_scheme == "fp8":
        special = torch.tensor([float("nan"), float("inf"), 1e-44, 0.0])[:g]
        buf[0, 0, cb : cb + 4 * special.numel()] = special.view(torch.uint8)
    else:
        special_b = torch.tensor([255, 0, 254] if codec.kernel_scheme == "mx" else [0x7F, 0, 0xFF], dtype=torch.uint8)
        buf[0, 0, cb : cb + min(g, 3)] = special_b[: min(g, 3)]
    if codec.kernel_scheme == "nvfp4":
        ts = torch.tensor([1.0, 0.0, 1e-41, 3e35, 1e-30])
        for j in range(k):
            for r in range(rows):
                buf[j, r, cb + g :] = ts[(r + j) % ts.numel()].reshape(1).view(torch.uint8)
    return buf


def out_widths(spec: QuantSpec) -> tuple[int, ...]:
    return tuple(sorted(schemes()[spec.scheme]))


def kernel_sums(module) -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
    """``(dequantize_sum, dequantize_sum_requantize)`` with the codec methods' signatures (the
    codec first) calling a kernel module's ``*_wire`` functions directly (``triton_format_reduce``
    on CPU tensors under the interpreter, which the codec would not dispatch to)."""

    def dsum(codec: FormatCodec, buf, cols, bits, gs, *, dtype=torch.float32):
        return module.dequantize_sum_wire(buf, codec.kernel_scheme, codec.element(bits), cols, gs, dtype=dtype)

    def requant(codec: FormatCodec, buf, cols, bits, gs, *, out_bits, seed):
        elem, out_elem = codec.element(bits), codec.element(out_bits)
        st, kseed = seed is not None, 0 if seed is None else seed
        return module.dequantize_sum_requantize_wire(
            buf, codec.kernel_scheme, elem, out_elem, cols, gs, codec.mx_scale, st, kseed
        )

    return dsum, requant


def check_case(
    monkeypatch: pytest.MonkeyPatch,
    codec: FormatCodec,
    buf: torch.Tensor,
    cols: int,
    bits: int,
    gs: int,
    widths: tuple[int, ...],
    seeds: tuple[Optional[int], ...] = (None, 1234),
    dtypes: tuple[torch.dtype, ...] = DTYPES,
    impl: Optional[tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]] = None,
) -> None:
    """Fused == generic for the sum in each dtype and for re-encoding at each width and seed.
    ``impl``: the two reductions to check (default: the codec's own methods)."""
    dsum, requant = impl or (type(codec).dequantize_sum, type(codec).dequantize_sum_requantize)
    for dtype in dtypes:
        want = reference(monkeypatch, Codec.dequantize_sum, codec, buf, cols, bits, gs, dtype=dtype)
        assert_same_bits(dsum(codec, buf, cols, bits, gs, dtype=dtype), want)
    for out_bits in widths:
        for seed in seeds:
            want = reference(
                monkeypatch, generic_sum_requantize, codec, buf, cols, bits, gs, out_bits=out_bits, seed=seed
            )
            got = requant(codec, buf, cols, bits, gs, out_bits=out_bits, seed=seed)
            assert got.dtype == torch.uint8 and torch.equal(got, want), (out_bits, seed)
