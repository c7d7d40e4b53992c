"""The Triton kernels of the float formats' reductions over received wire rows
(``kernels/triton_format_reduce.py``) against their specification, the codecs' generic path
computed by the pure-torch reference, bit for bit, on CPU tensors under TRITON_INTERPRET=1 (set by
conftest.py): every element format and MX scale rule, k = 1, 2, 4, 7, rows shorter than a block and
rows ending inside one, fp32 / bf16 / fp16 sums, nearest and stochastic re-encoding at every width
of the scheme, awkward inputs (zero blocks, subnormals, NaN / Inf blocks) and crafted wire bytes.
The interpreter is slow: sizes stay small, and the dtypes and output widths rotate over the cases
(each is met by every format; the native CPU tests take every combination)."""

from __future__ import annotations

import pytest
import torch

from tests.codec_cases import spec_id
from tests.format_reduce_helpers import FORMAT_SPECS, check_case, crafted_rows, kernel_sums, out_widths, received
from tests.kernel_helpers import DTYPES
from tests.triton_helpers import interpreted
from zeropp.comm.codecs import codec_for
from zeropp.comm.format_codecs import FormatCodec
from zeropp.comm.spec import QuantSpec
from zeropp.kernels._triton import HAS_TRITON

pytestmark = [
    pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed"),
    interpreted,
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter"),
]

CASES = [((1, 1), 7), ((1, 7), 2), ((3, 100), 4), ((2, 40), 1)]
"""((rows, cols), k): a lone element, less than a block, rows ending inside a block (Philox
offsets past row 0), and one source."""


def _triton():
    from zeropp.kernels import triton_format_reduce

    return kernel_sums(triton_format_reduce)


@pytest.mark.parametrize("spec", FORMAT_SPECS, ids=spec_id)
def test_triton_sums_are_the_generic_sums_bit_for_bit(spec: QuantSpec, monkeypatch) -> None:
    codec = codec_for(spec)
    assert isinstance(codec, FormatCodec)
    for i, ((rows, cols), k) in enumerate(CASES):
        buf = received(codec, spec, k, rows, cols, seed=3 * i + k)
        widths = out_widths(spec)
        dtypes = DTYPES if i == 2 else (DTYPES[i % 3],)
        check_case(
            monkeypatch,
            codec,
            buf,
            cols,
            spec.bits,
            spec.group_size,
            (widths[i % len(widths)],),
            dtypes=dtypes,
            impl=_triton(),
        )


@pytest.mark.parametrize("spec", FORMAT_SPECS, ids=spec_id)
def test_triton_sums_of_crafted_wire_bytes_are_the_generic_sums(spec: QuantSpec, monkeypatch) -> None:
    codec = codec_for(spec)
    assert isinstance(codec, FormatCodec)
    buf = crafted_rows(codec, spec.bits, 3, 2, 70, spec.group_size, seed=70)
    check_case(
        monkeypatch,
        codec,
        buf,
        70,
        spec.bits,
        spec.group_size,
        out_widths(spec),
        seeds=(None, 7),
        dtypes=(torch.float32, torch.bfloat16),
        impl=_triton(),
    )


def test_compile_check_covers_every_reduction_kernel():
    """``compile_check`` (run by tests/e2e/test_kernels_triton.py) compiles the sum kernel of every
    element format of every scheme and a fused re-quantize from every fp8 / mx element format,
    with the launchers' constexprs; a format added without a variant fails here."""
    from zeropp.kernels import compile_check
    from zeropp.kernels.format_layout import SCHEME_ELEMENTS

    names = [v[0] for v in compile_check._format_variants(False)]
    for scheme, elems in SCHEME_ELEMENTS.items():
        for elem in elems:
            assert f"format {scheme}/{elem} dequantize_sum -> bf16" in names, (scheme, elem)
            if scheme != "nvfp4":  # nvfp4 re-quantizes with the sum and quantize kernels
                for st in (False, True):
                    assert any(
                        n.startswith(f"format {scheme}/{elem} -> ") and n.endswith(f"requantize stochastic={st}")
                        for n in names
                    ), (scheme, elem, st)
