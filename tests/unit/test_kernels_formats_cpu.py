"""The native CPU kernels of the float formats (kernels/cpu_formats.py) against the reference
(kernels/format_reference.py), bit for bit: every scheme, element format and MX scale rule, on
awkward sizes, fp32 / bf16 / fp16 inputs and outputs, zero blocks, subnormals, values beyond the
formats' range, NaN / Inf blocks, stochastic rounding, and crafted wire bytes (every code, NaN
scales) for dequantize."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from tests.kernel_helpers import DTYPES, gaussian
from zeropp.kernels import cpu_format_library, cpu_formats, cpu_native, format_ops, reference
from zeropp.kernels import format_reference as ref
from zeropp.kernels.format_layout import ELEMENTS, FormatTensor, code_bytes, num_groups

FORMATS = [
    ("fp8", "e4m3", "ocp"),
    ("fp8", "e5m2", "ocp"),
    *[("mx", e, rule) for e in ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1", "int8") for rule in ("ocp", "round_up")],
    ("nvfp4", "e2m1", "ocp"),
]
"""(scheme, element, MX scale rule) of every format the kernels take."""

SHAPES = [((1,), 1), ((7,), 1), ((17, 257), 17), ((2, 1000), 2), ((3, 64), 3)]
"""Shorter than a block, one partial block, many rows with a partial last block, whole-and-partial
fp8 groups (group 96 below), and rows of whole MX / NVFP4 blocks."""

FP8_GROUP = 96
"""The fp8 group size of these tests: not a multiple of the MX / NVFP4 blocks, nor a power of two."""


@pytest.fixture(autouse=True)
def native_formats(monkeypatch):
    """The native kernels on (skip where they cannot be built here)."""
    monkeypatch.setattr(cpu_native, "ENABLED", True)
    if not cpu_formats.available():
        pytest.skip(f"native CPU format kernels unavailable here: {cpu_format_library.FAILED}")


@pytest.fixture(scope="module")
def narrow_library(tmp_path_factory):
    """``narrow_library(flag)``: the path of ``cpu_formats.cpp`` built with the usual flags plus
    ``flag`` (what a CPU without that feature runs), built once per module: a build takes some 10
    CPU-seconds, and two tests read the ``-mno-avx512f`` one."""
    built: dict[str, str] = {}

    def path(flag: str) -> str:
        if flag not in built:
            out = tmp_path_factory.mktemp("narrow") / "narrow.so"
            _, build = cpu_native.named_build(
                cpu_formats.SOURCE, [*cpu_native.FLAGS, flag], "zf", cpu_format_library.HEADERS
            )
            build(out)
            built[flag] = str(out)
        return built[flag]

    return path


def awkward_formats(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Gaussian data whose magnitude sweeps 2**-140 .. 2**120 along the tensor (clipped to the
    dtype's range), with a zero block, a -0.0 run, fp32 subnormals, values beyond every format's
    range, and a NaN and an Inf block where the tensor is big enough."""
    n = math.prod(shape)
    g = gaussian(n, seed)
    exps = torch.linspace(-140, 120, n) if n > 1 else torch.zeros(1)
    x = g * torch.pow(2.0, exps.floor())
    if n > 300:
        x[100:140] = 0
        x[290:300] = -0.0
        x[150:160] = torch.tensor([1e-45, -3e-42, 1e-39, -1e-38, 2e-40, 5e-44, -1e-45, 7e-39, 1e-40, -2e-41])
        x[170] = 1e30
        x[171] = -3e38
        x[200] = float("nan")
        x[260] = float("inf")
        x[261] = -float("inf")
    info = torch.finfo(dtype)
    finite = torch.isfinite(x)
    x = torch.where(finite, x.clamp(-info.max, info.max), x)
    return x.view(shape).to(dtype)


def quantize(impl_mod, x: torch.Tensor, scheme: str, elem: str, rule: str, rows: int, **kw) -> FormatTensor:
    """``quantize_<scheme>`` of ``cpu_formats`` (impl_mod None: the reference)."""
    name = f"quantize_{scheme}"
    fn = getattr(ref, f"{name}_ref") if impl_mod is None else getattr(impl_mod, name)
    if scheme == "fp8":
        return fn(x, elem, FP8_GROUP, rows=rows, **kw)
    if scheme == "mx":
        return fn(x, elem, scale_rule=rule, rows=rows, **kw)
    return fn(x, rows=rows, **kw)


def bits(t: torch.Tensor | None) -> torch.Tensor | None:
    """A tensor's raw bits (NaN payloads and signed zeros compared too)."""
    if t is None:
        return None
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def assert_same_values(a: torch.Tensor, b: torch.Tensor) -> None:
    """Same dtype, NaN in the same places, and every other element bit for bit (signed zeros
    included). NaN payloads are not compared: torch's own bf16 / fp16 casts write different NaN
    bits on different paths (its vectorised bf16 cast writes 0xFFFF, its scalar one 0x7FC0)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    nan = torch.isnan(a)
    assert torch.equal(nan, torch.isnan(b))
    assert torch.equal(bits(a)[~nan], bits(b)[~nan])


def assert_same(a: FormatTensor, b: FormatTensor) -> None:
    assert (a.cols, a.scheme, a.elem, a.group_size) == (b.cols, b.scheme, b.elem, b.group_size)
    assert torch.equal(a.codes, b.codes)
    assert torch.equal(bits(a.scales), bits(b.scales))
    if a.tensor_scales is None:
        assert b.tensor_scales is None
    else:
        assert torch.equal(bits(a.tensor_scales), bits(b.tensor_scales))


@pytest.mark.parametrize("scheme, elem, rule", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_native_quantize_and_dequantize_are_bit_identical_to_the_reference(scheme, elem, rule, dtype):
    for shape, rows in SHAPES:
        x = awkward_formats(shape, dtype, seed=rows)
        for stochastic in (False, True):
            kw = dict(stochastic=stochastic, seed=1234 + rows)
            ours, want = (
                quantize(cpu_formats, x, scheme, elem, rule, rows, **kw),
                quantize(None, x, scheme, elem, rule, rows, **kw),
            )
            assert_same(ours, want)
        for out_dtype in DTYPES:
            deq = getattr(cpu_formats, f"dequantize_{scheme}")(want, dtype=out_dtype)
            expect = getattr(ref, f"dequantize_{scheme}_ref")(want, dtype=out_dtype)
            assert_same_values(deq, expect)


def test_the_awkward_input_reaches_every_special_block():
    """The input above really holds what the exactness test claims: zero, NaN and Inf blocks,
    fp32 subnormals, and values beyond the largest format's range."""
    x = awkward_formats((17, 257), torch.float32)
    flat = x.view(-1)
    assert (flat[100:140] == 0).all() and torch.isnan(flat).any() and torch.isinf(flat).any()
    tiny = flat[torch.isfinite(flat) & (flat != 0)].abs()
    assert (tiny < torch.finfo(torch.float32).tiny).sum() >= 8
    assert flat[torch.isfinite(flat)].abs().max() > 57344
    q = ref.quantize_mx_ref(x, "e4m3", rows=17)
    assert (q.scales == 255).any() and (q.scales == 0).any()


def crafted(scheme: str, elem: str, rows: int, cols: int, seed: int) -> FormatTensor:
    """A FormatTensor of random wire bytes: every code (NaN / Inf codes of E4M3 / E5M2 included)
    and scales that are random bit patterns (fp8: NaN, Inf, subnormal and huge fp32 scales; mx:
    every E8M0 code, 255 included; nvfp4: every E4M3 code, 0x7F / 0xFF included, with random
    tensor scales)."""
    gs = {"fp8": FP8_GROUP, "mx": 32, "nvfp4": 16}[scheme]
    gen = torch.Generator().manual_seed(seed)
    g = num_groups(cols, gs)
    codes = torch.randint(0, 256, (rows, code_bytes(cols, elem, gs)), generator=gen, dtype=torch.uint8)
    t = None
    if scheme == "fp8":
        scales = torch.randint(-(2**31), 2**31, (rows, g), generator=gen, dtype=torch.int32).view(torch.float32)
        scales[0, :4] = torch.tensor([float("nan"), float("inf"), 1e-44, 0.0])[: scales.shape[1]]
    else:
        scales = torch.randint(0, 256, (rows, g), generator=gen, dtype=torch.uint8)
        scales[0, 0] = 255 if scheme == "mx" else 0x7F
        if scheme == "nvfp4":
            t = torch.tensor([[1.0], [1e-30], [3e35], [1e-41], [0.0]])[:rows].clone()
    return FormatTensor(codes, scales, t, cols, scheme, elem, gs)


@pytest.mark.parametrize("scheme, elem", sorted({(s, e) for s, e, _ in FORMATS}))
def test_native_dequantize_of_crafted_wire_bytes_is_bit_identical(scheme, elem):
    for cols in (1, 7, 100, 257):
        q = crafted(scheme, elem, 5, cols, seed=cols)
        for out_dtype in DTYPES:
            ours = getattr(cpu_formats, f"dequantize_{scheme}")(q, dtype=out_dtype)
            want = getattr(ref, f"dequantize_{scheme}_ref")(q, dtype=out_dtype)
            assert_same_values(ours, want)


@pytest.mark.parametrize("elem", list(ELEMENTS))
def test_every_code_of_every_element_decodes_as_the_reference(elem):
    """Each code once per position in an MX block, at a scale of 1 (E8M0 127) and at the extreme
    scales 2**-127 and 2**127 (subnormal and overflowing products)."""
    f = ELEMENTS[elem]
    n = 2**f.bits
    codes = torch.arange(n, dtype=torch.int32).repeat(96 // n + 1)[:96].view(1, 96)
    from zeropp.kernels.format_layout import pack_codes

    packed = pack_codes(codes, f.bits).expand(3, -1).contiguous()
    scales = torch.tensor([[127] * 3, [0] * 3, [254] * 3], dtype=torch.uint8)
    q = FormatTensor(packed, scales, None, 96, "mx", elem, 32)
    for out_dtype in DTYPES:
        assert_same_values(cpu_formats.dequantize_mx(q, dtype=out_dtype), ref.dequantize_mx_ref(q, dtype=out_dtype))


NV_TENSOR_SCALES = (1.0, 1e-30, 3e35, 1e-41, 0.0, 2.0**-126, 448.0, float("inf"), float("nan"))
"""Row scales of the every-code NVFP4 wire rows: ordinary, tiny (subnormal products), huge
(overflowing products), an fp32 subnormal, zero, the smallest normal, and non-finite (which crafted
wire bytes may carry)."""


def every_code_under_every_scale(scheme: str, elem: str) -> FormatTensor:
    """Wire rows where each block scale code (mx: the 256 E8M0 codes, 255 included; nvfp4: the 256
    E4M3 codes, 0x7F / 0xFF included) meets every element code: mx rows of 256 blocks, block g of
    row r holding codes (i + 32 r + g) % 64 (rows 0 and 1 together give each scale every 6-bit
    code); nvfp4 rows of 256 blocks, each block every E2M1 code, one row per tensor scale in
    ``NV_TENSOR_SCALES``."""
    from zeropp.kernels.format_layout import pack_codes

    f = ELEMENTS[elem]
    gs = 32 if scheme == "mx" else 16
    rows = 2 if scheme == "mx" else len(NV_TENSOR_SCALES)
    i = torch.arange(gs).view(1, 1, gs)
    g = torch.arange(256).view(1, 256, 1)
    r = torch.arange(rows).view(rows, 1, 1)
    codes = (i + (32 if scheme == "mx" else 0) * r + g) % 2**f.bits
    packed = pack_codes(codes.reshape(rows, -1), f.bits)
    scales = torch.arange(256, dtype=torch.uint8).repeat(rows, 1)
    t = torch.tensor(NV_TENSOR_SCALES).view(-1, 1) if scheme == "nvfp4" else None
    return FormatTensor(packed, scales, t, 256 * gs, scheme, elem, gs)


def cut(q: FormatTensor, rows: int, cols: int) -> FormatTensor:
    """The first ``rows`` rows and ``cols`` elements of ``q`` (whole blocks kept, as the wire has them)."""
    g = num_groups(cols, q.group_size)
    nb = code_bytes(cols, q.elem, q.group_size)
    t = None if q.tensor_scales is None else q.tensor_scales[:rows].contiguous()
    return FormatTensor(
        q.codes[:rows, :nb].contiguous(), q.scales[:rows, :g].contiguous(), t, cols, q.scheme, q.elem, q.group_size
    )


DEQ_VECTOR_FORMATS = [("mx", "e3m2"), ("mx", "e2m3"), ("nvfp4", "e2m1")]
"""The formats whose dequantize has whole-row AVX-512 kernels (cpu_formats_deq.h)."""


def check_every_code_under_every_scale(scheme: str, elem: str) -> None:
    q = every_code_under_every_scale(scheme, elem)
    fn, want_fn = getattr(cpu_formats, f"dequantize_{scheme}"), getattr(ref, f"dequantize_{scheme}_ref")
    # the whole rows, then shorter ones: a partial last block, lengths that are not a multiple of
    # the block or of 16 / 32 lanes, a single element, an odd number of blocks
    for rows, cols in (
        (q.rows, q.cols),
        (q.rows, q.cols - 5),
        (1, 1),
        (q.rows, 7),
        (1, 17),
        (q.rows, 49),
        (2, 16 * 37 + 3),
    ):
        part = q if (rows, cols) == (q.rows, q.cols) else cut(q, rows, cols)
        for out_dtype in DTYPES:
            assert_same_values(fn(part, dtype=out_dtype), want_fn(part, dtype=out_dtype))


@pytest.mark.parametrize("scheme, elem", DEQ_VECTOR_FORMATS)
def test_dequantize_of_every_code_under_every_scale_code(scheme, elem):
    check_every_code_under_every_scale(scheme, elem)


@pytest.mark.parametrize("scheme, elem", DEQ_VECTOR_FORMATS)
@pytest.mark.parametrize("rows, cols", [(1, 1), (1, 7), (17, 257), (3, 2048 + 32 * 5 + 11), (2, 4096)])
def test_dequantize_of_crafted_rows_of_awkward_shapes(scheme, elem, rows, cols):
    q = crafted(scheme, elem, min(rows, 5), cols, seed=rows * cols)
    if rows > 5:  # more rows than crafted's tensor scales: repeat them
        q = FormatTensor(
            q.codes.repeat(4, 1)[:rows].contiguous(),
            q.scales.repeat(4, 1)[:rows].contiguous(),
            None if q.tensor_scales is None else q.tensor_scales.repeat(4, 1)[:rows].contiguous(),
            cols,
            scheme,
            elem,
            q.group_size,
        )
    fn, want_fn = getattr(cpu_formats, f"dequantize_{scheme}"), getattr(ref, f"dequantize_{scheme}_ref")
    for out_dtype in DTYPES:
        assert_same_values(fn(q, dtype=out_dtype), want_fn(q, dtype=out_dtype))


@pytest.mark.parametrize("flag", ["-mno-avx512f", "-mno-avx512bf16"])
def test_dequantize_built_without_avx512_or_its_bf16_gives_the_same_bits(flag, narrow_library, monkeypatch):
    """The scalar dequantize (no AVX-512) and the vector one whose bf16 outputs all take the
    integer rounding (no AVX512-BF16) decode every code under every scale as the reference."""
    monkeypatch.setattr(cpu_format_library, "_LIB", cpu_format_library._load(narrow_library(flag)))
    for scheme, elem in DEQ_VECTOR_FORMATS:
        check_every_code_under_every_scale(scheme, elem)


def test_stochastic_rounding_follows_the_seed():
    x = gaussian(4096, 5).view(4, 1024)
    a = cpu_formats.quantize_mx(x, "e2m1", rows=4, stochastic=True, seed=7)
    b = cpu_formats.quantize_mx(x, "e2m1", rows=4, stochastic=True, seed=8)
    assert not torch.equal(a.codes, b.codes)
    assert_same(a, ref.quantize_mx_ref(x, "e2m1", rows=4, stochastic=True, seed=7))


@pytest.mark.parametrize("n", [2, 37, 134])
@pytest.mark.parametrize("base", [0, 5, 2**34 - 23, 2**64 - 141])
def test_the_kernels_philox_stream_is_the_reference_stream(base, n):
    # one Philox counter per four offsets: base 5 starts inside a counter; 2 offsets are a scalar
    # counter, 37 a part vector of 16 counters, 134 two whole vectors and a part vector (base 0) or
    # a scalar tail (base 5); 2**34 - 23 carries into the high counter word inside a vector,
    # 2**64 - 141 ends at the last offset (read as uint64)
    seed = 0x1234_5678_9ABC_DEF0
    want = reference.philox_uniform(
        seed, torch.arange(n, dtype=torch.int64) + (base - 2**64 if base >= 2**63 else base)
    )
    assert torch.equal(bits(cpu_formats.philox_uniform(seed, base, n)), bits(want))


@pytest.mark.parametrize("scheme, elem", [("nvfp4", "e2m1"), ("mx", "e3m2"), ("mx", "e2m1")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_of_many_tiles_with_special_blocks_in_a_later_tile(scheme, elem, dtype):
    # 5000 columns: three tiles of the kernels (the last partial), the row's largest finite value
    # and a NaN / Inf block only in the second tile, a zero row, so the per-row tensor scale and
    # the per-tile block scales meet every case away from the first tile
    x = gaussian(3 * 5000, 11).view(3, 5000).to(dtype)
    x[0, 3000] = 300.0
    x[0, 2500] = float("nan")
    x[0, 4100] = -float("inf")
    x[1, 4999] = float("inf")
    x[2] = 0
    for stochastic in (False, True):
        kw = dict(rows=3, stochastic=stochastic, seed=99)
        ours = quantize(cpu_formats, x, scheme, elem, "ocp", **kw)
        want = quantize(None, x, scheme, elem, "ocp", **kw)
        assert_same(ours, want)
    deq = getattr(cpu_formats, f"dequantize_{scheme}")(want, dtype=dtype)
    assert_same_values(deq, getattr(ref, f"dequantize_{scheme}_ref")(want, dtype=dtype))


E2M1_TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
"""Where round-to-nearest-even of an E2M1 element changes code (0.25, 1.25, 2.5 and 5 round down,
the others up)."""


def nvfp4_ties(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows whose scaled elements land exactly on every E2M1 rounding tie and one input ulp either
    side: each row's largest value is 2688 * 2**k, so its tensor scale is 2**k, and a block whose
    absmax is 6 * 2**(k + j) gets the E4M3 scale 2**j (j from -9, a subnormal E4M3 scale, to 8),
    so that its elements are divided by the power of two 2**(k + j) exactly. Other blocks hold
    Gaussian data; some blocks are zero."""
    x = gaussian(rows * cols, seed).view(rows, cols)
    itype = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[dtype]
    gen = torch.Generator().manual_seed(seed)
    k = 0 if dtype == torch.float16 else 3
    for r in range(rows):
        x[r, 0] = 2688.0 * 2.0**k
        for b in range(1, (cols + 15) // 16):
            kind = int(torch.randint(0, 4, (1,), generator=gen))
            lo, hi = 16 * b, min(16 * b + 16, cols)
            if kind == 0:
                x[r, lo:hi] = 0
            elif kind >= 2:
                j = int(torch.randint(-9, 9, (1,), generator=gen))
                d = 2.0 ** (k + j)
                pick = torch.randint(0, len(E2M1_TIES), (hi - lo,), generator=gen)
                sign = torch.where(torch.rand(hi - lo, generator=gen) < 0.5, -1.0, 1.0)
                x[r, lo:hi] = torch.tensor(E2M1_TIES)[pick] * sign * d
                x[r, lo] = 6.0 * d
    x = x.to(dtype)
    # one input ulp up or down for a third of the elements (away from each row's maximum)
    step = torch.randint(-1, 2, x.shape, generator=gen).to(itype)
    step[:, 0] = 0
    bits_ = x.view(itype)
    moved = (bits_ + torch.where(x != 0, step, torch.zeros_like(step))).view(dtype)
    return torch.where(torch.isfinite(moved), moved, x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [16, 37, 48, 2048, 2128, 2048 + 16 * 31 + 9, 4096 + 16 * 33])
def test_nvfp4_elements_on_every_rounding_tie(cols, dtype):
    # whole and partial tiles (2048 elements), trees of 16 / 32 blocks cut short (odd block
    # counts), a partial last block, several rows
    x = nvfp4_ties(3, cols, dtype, seed=cols)
    for stochastic in (False, True):
        kw = dict(rows=3, stochastic=stochastic, seed=5)
        assert_same(cpu_formats.quantize_nvfp4(x, **kw), ref.quantize_nvfp4_ref(x, **kw))


def test_nvfp4_ties_really_are_ties():
    """The tie input above divides to the exact E2M1 ties: the reference's scaled values (x / d)
    hit each tie many times."""
    x = nvfp4_ties(3, 2128, torch.float32, seed=1)
    q = ref.quantize_nvfp4_ref(x, rows=3)
    assert q.tensor_scales is not None
    d = (ref.decode_elements(q.scales.to(torch.int32), "e4m3") * q.tensor_scales).repeat_interleave(16, dim=1)
    v = (x / d[:, : x.shape[1]]).abs()
    for tie in E2M1_TIES:
        assert (v == tie).sum() >= 20


@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_long_awkward_rows(dtype):
    # the awkward data (magnitudes 2**-140 .. 2**120, subnormals, zero, NaN and Inf blocks) in
    # rows of several tiles
    x = awkward_formats((2, 4200), dtype, seed=3)
    for stochastic in (False, True):
        kw = dict(rows=2, stochastic=stochastic, seed=8)
        assert_same(cpu_formats.quantize_nvfp4(x, **kw), ref.quantize_nvfp4_ref(x, **kw))


def test_the_build_without_avx512_gives_the_same_bits(narrow_library, monkeypatch):
    """The library built without AVX-512 (the scalar nvfp4 tiles, and what CPUs without AVX-512
    run) quantizes nvfp4 to the reference's bits too: the ties, long awkward rows, every dtype."""
    monkeypatch.setattr(cpu_format_library, "_LIB", cpu_format_library._load(narrow_library("-mno-avx512f")))
    for dtype in DTYPES:
        for x, rows in ((nvfp4_ties(3, 2128, dtype, seed=2), 3), (awkward_formats((2, 4200), dtype, seed=4), 2)):
            for stochastic in (False, True):
                kw = dict(rows=rows, stochastic=stochastic, seed=3)
                assert_same(cpu_formats.quantize_nvfp4(x, **kw), ref.quantize_nvfp4_ref(x, **kw))


def test_strided_input_and_out_buffers():
    """A non-contiguous input (a transposed view) and a caller's ``out`` of another shape."""
    x = gaussian(40 * 33, 2).view(33, 40).t()  # [40, 33], rows not contiguous
    for scheme, elem, rule in (("fp8", "e4m3", "ocp"), ("mx", "e3m2", "ocp"), ("nvfp4", "e2m1", "ocp")):
        q = quantize(cpu_formats, x, scheme, elem, rule, 40)
        assert_same(q, quantize(None, x, scheme, elem, rule, 40))
        out = torch.empty(40 * 33, dtype=torch.bfloat16)
        got = getattr(cpu_formats, f"dequantize_{scheme}")(q, out=out)
        assert got is out
        assert_same_values(out, getattr(ref, f"dequantize_{scheme}_ref")(q, dtype=torch.bfloat16).view(-1))


def test_cpu_tensors_dispatch_to_the_native_kernels():
    cpu = torch.device("cpu")
    for name in (
        "quantize_fp8",
        "quantize_mx",
        "quantize_nvfp4",
        "dequantize_fp8",
        "dequantize_mx",
        "dequantize_nvfp4",
    ):
        assert format_ops.implementation(name, cpu) is getattr(cpu_formats, name)


def test_the_kernels_refuse_what_the_reference_refuses():
    x = torch.zeros(10)
    with pytest.raises(ValueError, match="element format 'e2m1' is not one of scheme 'fp8'"):
        cpu_formats.quantize_fp8(x, "e2m1", 32)
    with pytest.raises(ValueError, match="MX scale rule"):
        cpu_formats.quantize_mx(x, "e4m3", scale_rule="nearest")
    with pytest.raises(ValueError, match="cannot split"):
        cpu_formats.quantize_nvfp4(x, rows=3)
    with pytest.raises(ValueError, match="dequantize_mx takes a mx FormatTensor"):
        cpu_formats.dequantize_mx(cpu_formats.quantize_nvfp4(x))


def test_unavailable_kernels_warn_once_and_fall_back_to_the_reference(monkeypatch):
    monkeypatch.setattr(cpu_format_library, "_LIB", None)
    monkeypatch.setattr(cpu_format_library, "FAILED", "RuntimeError: no C++ compiler found")
    monkeypatch.setattr(cpu_format_library, "_warned", False)
    x = awkward_formats((3, 100), torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="float formats are unavailable .*no C\\+\\+ compiler found"):
        q = cpu_formats.quantize_nvfp4(x, rows=3)
    assert_same(q, ref.quantize_nvfp4_ref(x, rows=3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call is silent
        out = cpu_formats.dequantize_nvfp4(q)
    assert_same_values(out, ref.dequantize_nvfp4_ref(q))


# ----------------------------------------------------------------------------------------------
