"""The Triton kernels of the float formats (``kernels/triton_formats.py``) against their torch
reference (``kernels/format_reference.py``), bit for bit: same code bytes, same scale bits, same
output bits, run on CPU tensors under TRITON_INTERPRET=1 (set by conftest.py).

Sizes 1, 7, 17x257 as one row, and 3 rows of 100 (each ending inside a block; the 17 rows of 257
are in ``tests/e2e/test_kernels_formats_triton.py``); fp32/bf16/fp16; every element format of every
scheme, both MX scale rules, round to nearest and stochastic. The inputs
(``format_inputs``) carry zero blocks, -0.0, fp32 subnormals, values beyond every format's range,
NaN and Inf. The element encoders are also checked exhaustively: every code decodes to its value,
and every value, every midpoint between neighbours and the fp32 numbers on each side of it
encodes as the reference does. The interpreter is slow: sizes stay small.
"""

from __future__ import annotations

import pytest
import torch

from tests.format_kernel_helpers import (
    ELEMENT_CASES,
    SCHEME_CASES,
    assert_same_format,
    check_case,
    dequantize,
    format_inputs,
    probe_values,
    run,
)
from tests.kernel_helpers import DTYPES, assert_same_bits
from tests.triton_helpers import interpreted
from zeropp.kernels import format_reference as ref
from zeropp.kernels import triton_formats as tri
from zeropp.kernels._triton import HAS_TRITON
from zeropp.kernels.format_layout import FormatTensor

pytestmark = [
    pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed"),
    interpreted,
    pytest.mark.usefixtures("one_torch_thread"),
    # the interpreter runs the kernels' fp32 arithmetic in numpy, which warns on the IEEE overflow
    # and Inf * 0 these inputs provoke on purpose (the reference computes the same Inf / NaN)
    pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter"),
]

FP8_ONLY = ("e4m3", "e5m2")  # ELEMENT_CASES carries these through fp8, which has no scale rule
# (shape, rows): a lone element, less than a block, 17*257 as one row (it ends inside a block of
# every size), and 3 rows of 100 (rows that each end inside a block; Philox offsets past row 0).
# The 17 rows of 257 take ~2 s per format in the interpreter: tests/e2e/test_kernels_formats_triton.py
SHAPES = [((1,), 1), ((7,), 1), ((17, 257), 1), ((3, 100), 3)]


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,rows", SHAPES, ids=str)
@pytest.mark.parametrize("scheme,elem,rule,gs", SCHEME_CASES, ids=str)
def test_quantize_and_dequantize_bit_exact(scheme, elem, rule, gs, shape, rows):
    """Every scheme / element format / scale rule on every size, rounding to nearest; one dtype
    per case, rotating over the shapes and formats so that each format sees all three."""
    check_case(scheme, elem, rule, gs, shape, rows, DTYPES[(SHAPES.index((shape, rows)) + len(elem)) % 3], False)


@pytest.mark.parametrize("scheme,elem,rule,gs", SCHEME_CASES, ids=str)
def test_stochastic_rounding_bit_exact(scheme, elem, rule, gs):
    """Stochastic rounding draws Triton's Philox at the padded-layout position, as the reference
    does: several rows, each ending inside a block."""
    check_case(scheme, elem, rule, gs, (3, 100), 3, DTYPES[len(elem) % 3], True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scheme,elem,rule,gs", [SCHEME_CASES[i] for i in (0, 4, 6, 10)], ids=str)
def test_every_dtype_in_and_out(scheme, elem, rule, gs, dtype):
    """Each input dtype, dequantized to each dtype (bf16 output rounds on the bits), for each code
    width (8-bit fp8 and MXFP8, 6-bit MXFP6, 4-bit MXFP4 and NVFP4)."""
    x = format_inputs((3, 100), dtype, seed=3)
    q = run(scheme, tri, x, elem, 3, False, rule, gs)
    assert_same_format(q, run(scheme, ref, x, elem, 3, False, rule, gs))
    for out_dtype in DTYPES:
        assert_same_bits(dequantize(q, tri, out_dtype), dequantize(q, ref, out_dtype))


@pytest.mark.parametrize(
    "elem,rule", [(e, r) for e in sorted(ELEMENT_CASES) for r in ("ocp", "round_up") if r == "ocp" or e not in FP8_ONLY]
)
def test_elements_exhaustively(elem, rule):
    """Each element format's every code, every midpoint of two neighbours and the fp32 values
    beside each (ties to even, and the first values that round the other way), signed, plus
    fp32 subnormals, through blocks whose scale is exactly 1 (fp8: ``max / max``; mx: the block's
    absmax is the format's max, whose mantissa the round-up rule compares against: equal keeps
    the exponent)."""
    scheme, gs = ELEMENT_CASES[elem]
    v = probe_values(elem)
    want = run(scheme, ref, v, elem, 1, False, rule, gs)
    assert_same_format(run(scheme, tri, v, elem, 1, False, rule, gs), want)
    assert_same_bits(dequantize(want, tri, torch.float32), dequantize(want, ref, torch.float32))


@pytest.mark.parametrize("rule", ["ocp", "round_up"])
def test_mx_shared_exponents_at_the_extremes(rule):
    """One block per absmax around the ends of fp32 and of E8M0: fp32 subnormals (whose exponent
    must be read exactly, not as -127), the smallest normals, the largest finite values, and
    mantissas just under, at and over each format's max mantissa (1.5, 1.75, 1.875, 127/64: the
    round-up rule's cases)."""
    g = torch.Generator().manual_seed(11)
    tops = [2.0**-149, 3 * 2.0**-149, 1.99 * 2.0**-127, 2.0**-127, 1.9 * 2.0**-128, 2.0**-126, 1.0, 3.0e38]
    tops += [float(torch.finfo(torch.float32).max)]
    for mant in (1.5, 1.75, 1.875, 127 / 64):
        m = torch.tensor(mant)
        tops += [
            mant * 2.0**-140,
            mant * 4.0,
            float(torch.nextafter(m, torch.tensor(9.0))),
            float(torch.nextafter(m, torch.tensor(0.0))),
        ]
    blocks = torch.rand(len(tops), 32, generator=g) * 2 - 1
    blocks *= torch.tensor(tops).unsqueeze(1)
    blocks[:, 0] = torch.tensor(tops)
    for elem in ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1", "int8"):
        want = ref.quantize_mx_ref(blocks, elem, scale_rule=rule)
        assert_same_format(tri.quantize_mx(blocks, elem, scale_rule=rule), want)


def test_crafted_codes_decode_as_the_reference_does():
    """Codes no quantizer writes (E4M3 / E5M2 NaN codes with the sign set, E5M2 Inf codes, E8M0
    NaN and the extreme exponents, E4M3 NaN block scales): a received buffer may hold them."""
    g = torch.Generator().manual_seed(5)
    for scheme, elem, _, gs in SCHEME_CASES:
        q = run(scheme, ref, torch.zeros(2, 200), elem, 2, False, "ocp", gs)
        codes = torch.randint(0, 256, q.codes.shape, generator=g, dtype=torch.uint8)
        if scheme == "fp8":
            some = torch.tensor([1.0, -(2.0**-140), float("nan"), 3.0e38, float("inf"), 0.0, -5.0])
            scales = some[torch.arange(q.scales.numel()) % 7].view(q.scales.shape)
        else:
            scales = torch.randint(0, 256, q.scales.shape, generator=g, dtype=torch.uint8)
            scales[0, 0], scales[0, 1] = 255, 0
        t = torch.tensor([[2.0**-130], [7.5]]) if scheme == "nvfp4" else None
        crafted = FormatTensor(codes, scales, t, q.cols, scheme, elem, gs)
        for dtype in DTYPES:
            assert_same_bits(dequantize(crafted, tri, dtype), dequantize(crafted, ref, dtype))


def test_dequantize_into_a_row_strided_out_and_from_row_strided_codes():
    """``out`` may be columns of a larger buffer, and codes / scales views into a wire buffer."""
    x = format_inputs((3, 70), torch.float32, seed=9)
    q = tri.quantize_mx(x, "e3m2", rows=3)
    wide = torch.zeros(3, q.codes.shape[1] + q.scales.shape[1] + 5, dtype=torch.uint8)
    cb = q.codes.shape[1]
    wide[:, :cb], wide[:, cb : cb + q.scales.shape[1]] = q.codes, q.scales
    view = FormatTensor(wide[:, :cb], wide[:, cb : cb + q.scales.shape[1]], None, 70, "mx", "e3m2", 32)
    big = torch.full((3, 100), 7.0)
    tri.dequantize_mx(view, out=big[:, 10:80])
    assert_same_bits(big[:, 10:80], ref.dequantize_mx_ref(q))
    assert torch.equal(big[:, :10], torch.full((3, 10), 7.0)) and torch.equal(big[:, 80:], torch.full((3, 20), 7.0))


def test_same_refusals_as_the_reference():
    """A wrong element format, group size, scale rule, seed or uneven split is refused by the
    Triton functions with the reference's own message, before anything launches."""
    x = torch.ones(10)
    cases = [
        (lambda m, s: getattr(m, "quantize_fp8" + s)(x, "e2m1", 4), "e2m1"),
        (lambda m, s: getattr(m, "quantize_mx" + s)(x, "e4m3", scale_rule="up"), "scale rule"),
        (lambda m, s: getattr(m, "quantize_nvfp4" + s)(x, rows=3), "equal rows"),
        (lambda m, s: getattr(m, "quantize_fp8" + s)(x, "e4m3", 0), "group_size"),
        (lambda m, s: getattr(m, "quantize_mx" + s)(x, "int8", seed=-1), "seed"),
    ]
    for call, needle in cases:
        with pytest.raises(ValueError, match=needle) as want:
            call(ref, "_ref")
        with pytest.raises(ValueError) as got:
            call(tri, "")
        assert str(got.value) == str(want.value)


def test_compile_check_covers_every_format_kernel():
    """``compile_check`` (run by tests/e2e/test_kernels_triton.py) compiles each format kernel:
    every element format of every scheme in quantize and dequantize, both MX rules, nvfp4's
    absmax pass, with the launchers' constexprs. A format added to the layout without a
    variant there fails here."""
    from zeropp.kernels import compile_check
    from zeropp.kernels.format_layout import SCALE_RULES, SCHEME_ELEMENTS

    names = [v[0] for v in compile_check._format_variants(False)]
    for scheme, elems in SCHEME_ELEMENTS.items():
        for elem in elems:
            assert any(n.startswith(f"format {scheme}/{elem} ") and " quantize " in n for n in names), (scheme, elem)
            assert f"format {scheme}/{elem} dequantize -> bf16" in names, (scheme, elem)
    assert all(any("format mx/" in n and f" {r} quantize" in n for n in names) for r in SCALE_RULES)
    assert "format nvfp4 row absmax bf16" in names


@pytest.mark.parametrize("scheme,elem,rule,gs", [SCHEME_CASES[i] for i in (0, 4, 10)], ids=str)
def test_empty_rows_launch_nothing_and_match_the_reference(scheme, elem, rule, gs):
    """Zero elements (one row, or three rows of none): no kernel runs, and the result is the
    reference's (empty codes and scales; nvfp4's row scales 0)."""
    for x, rows in ((torch.empty(0), 1), (torch.empty(3, 0), 3)):
        want = run(scheme, ref, x, elem, rows, False, rule, gs)
        got = run(scheme, tri, x, elem, rows, False, rule, gs)
        assert_same_format(got, want)
        assert_same_bits(dequantize(got, tri, torch.float16), dequantize(want, ref, torch.float16))


def test_cpu_tensors_without_the_interpreter_are_refused_clearly(monkeypatch):
    """The compiled kernels need CUDA tensors: a CPU tensor without TRITON_INTERPRET=1 gets the
    int kernels' message (what to set, or which impl to use) instead of an error deep in Triton."""
    q = tri.quantize_mx(torch.ones(40), "e2m1")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for call in (lambda: tri.quantize_mx(torch.ones(40), "e2m1"), lambda: tri.dequantize_mx(q)):
        with pytest.raises(RuntimeError, match="need TRITON_INTERPRET=1 set before triton is imported"):
            call()
