"""The codec registry: a scheme registered in a test reaches every collective unchanged.

Here: the one-process checks. The topic's full description and its gloo-world checks are in
``tests/distributed/test_comm_codecs.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.codec_cases import format_variants, registry_specs, spec_id
from tests.toy_codec import OffsetCodec
from zeropp.comm.codecs import Codec, IntCodec, codec_for, codecs, register_codec, unregister_codec
from zeropp.comm.spec import QuantSpec, register_scheme, schemes, unregister_scheme


@pytest.fixture
def offset_scheme():
    register_codec("offset", OffsetCodec(), bits=(8,))
    yield
    unregister_codec("offset")


def test_unregistered_scheme_fails_in_quantspec() -> None:
    with pytest.raises(ValueError, match=r"QuantSpec.scheme='hadamard' is not registered; use one of \['fp8', 'int'"):
        QuantSpec(bits=8, scheme="hadamard")
    assert "hadamard" not in schemes()


def test_register_and_unregister(offset_scheme) -> None:
    assert schemes()["offset"] == (8,) and isinstance(codecs()["offset"], OffsetCodec)
    spec = QuantSpec(bits=8, scheme="offset")
    assert isinstance(codec_for(spec), OffsetCodec) and spec.label == "offset8"
    with pytest.raises(ValueError, match=r"QuantSpec.bits=4 is not supported by scheme 'offset'; use one of \(8,\)"):
        QuantSpec(bits=4, scheme="offset")
    unregister_codec("offset")
    with pytest.raises(ValueError, match="is not registered"):
        QuantSpec(bits=8, scheme="offset")
    with pytest.raises(ValueError, match="is not registered"):  # a spec made before still fails loudly
        codec_for(spec)


def test_registry_refuses_bad_registrations() -> None:
    with pytest.raises(TypeError, match="must subclass zeropp.comm.codecs.Codec"):
        register_codec("bad", object(), bits=(8,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'int' cannot be replaced"):
        register_codec("int", IntCodec(), bits=(8, 4))
    with pytest.raises(ValueError, match="bits must be a non-empty tuple"):
        register_codec("bad", OffsetCodec(), bits=())
    assert "bad" not in schemes() and "bad" not in codecs()
    register_scheme("declared_only", (8,))  # a scheme without kernels: a clear error when used
    try:
        with pytest.raises(ValueError, match=r"has no codec; register it with .*register_codec\('declared_only'"):
            codec_for(QuantSpec(bits=8, scheme="declared_only"))
    finally:
        unregister_scheme("declared_only")


def test_int_codec_wire_row_is_codes_then_scales() -> None:
    """The int wire format: a packed row is exactly what kernels.quantized_nbytes counts, and
    unpack inverts pack for stacked leading dims."""
    from zeropp.kernels import quantized_nbytes

    c = IntCodec()
    x = torch.randn(3, 2, 37)
    for bits in (8, 4):
        q = c.quantize(x, bits, 16, rows=6, seed=None)
        buf = c.pack(q)
        assert buf.dtype == torch.uint8 and buf.shape == (6, c.wire_bytes(37, bits, 16))
        assert c.wire_bytes(37, bits, 16) == quantized_nbytes(1, 37, bits, 16)
        back = c.unpack(buf.view(3, 2, -1), 37, bits, 16)
        assert torch.equal(back.codes.view(6, -1), q.codes) and torch.equal(back.scales.view(6, -1), q.scales)
        assert torch.equal(
            c.dequantize_sum(buf.view(3, 2, -1), 37, bits, 16),
            Codec.dequantize_sum(c, buf.view(3, 2, -1), 37, bits, 16),
        )  # fused == generic


# ----------------------------------------------------------------------------------------------
# Every registered codec (tests/codec_cases.py): the wire contract the collectives rely on.
# ----------------------------------------------------------------------------------------------
ALL_SPECS = registry_specs() + format_variants()
MAX_REL_ERR = {8: 0.1, 6: 0.2, 4: 0.35}
"""Relative error (L2) of one round trip to nearest of Gaussian rows: a loose ceiling (E5M2, the
coarsest 8-bit element, measures 0.04; E2M1 0.12)."""


def _rows(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(6, 75, generator=g) * torch.logspace(-2, 1, 6).unsqueeze(1)  # [6, 75]: rows of mixed scale


@pytest.mark.parametrize("rotated", [False, True], ids=["plain", "hadamard"])
@pytest.mark.parametrize("spec", ALL_SPECS, ids=spec_id)
def test_every_codec_keeps_the_wire_contract(spec: QuantSpec, rotated: bool) -> None:
    """encode == pack(quantize), rows of exactly wire_bytes, unpack inverts pack for stacked
    leading dims, the generic sums equal their definition, and a round trip stays close."""
    if rotated:
        spec = spec.replace(rotation="hadamard", hadamard_block=16)
    c, gs, x = codec_for(spec), spec.group_size, _rows()
    for seed in (5, None):  # stochastic, then the nearest rows the rest of the test reads
        buf = c.encode(x, spec.bits, gs, rows=6, seed=seed)
        assert buf.dtype == torch.uint8 and buf.shape == (6, c.wire_bytes(75, spec.bits, gs))
        assert torch.equal(buf, c.pack(c.quantize(x, spec.bits, gs, rows=6, seed=seed)))
    y = c.dequantize(c.unpack(buf, 75, spec.bits, gs))  # [6, 75]
    assert y.shape == (6, 75) and float((y - x).norm() / x.norm()) < MAX_REL_ERR[spec.bits]
    stacked = buf.view(2, 3, -1)  # [k=2, rows=3, B]
    q2 = c.unpack(stacked, 75, spec.bits, gs)
    assert torch.equal(c.pack(q2), stacked)
    want = torch.zeros(3, 75)
    for i in range(2):
        want += c.dequantize(c.unpack(stacked[i], 75, spec.bits, gs)).view(3, 75)
    if not rotated:  # rotated sums stay in the rotated basis and rotate back once: equal up to rounding
        assert torch.equal(c.dequantize_sum(stacked, 75, spec.bits, gs), want)
    else:
        assert torch.allclose(c.dequantize_sum(stacked, 75, spec.bits, gs), want, atol=1e-5 * float(want.abs().max()))
    bits2 = min(schemes()[spec.scheme])
    hop2 = c.dequantize_sum_requantize(stacked, 75, spec.bits, gs, out_bits=bits2, seed=None)
    assert hop2.shape == (3, c.wire_bytes(75, bits2, gs)) and hop2.dtype == torch.uint8
    if not rotated:
        assert torch.equal(hop2, c.encode(c.dequantize_sum(stacked, 75, spec.bits, gs), bits2, gs, rows=3, seed=None))


@pytest.mark.parametrize(
    "spec, cols, nbytes",
    [
        (QuantSpec(bits=8, group_size=16), 37, 48 + 3 * 4),  # int: codes of 3 padded groups + fp32 scales
        (QuantSpec(bits=4, group_size=16), 37, 24 + 3 * 4),
        (QuantSpec(scheme="fp8", bits=8, group_size=64), 100, 128 + 2 * 4),
        (QuantSpec(scheme="mx", bits=8), 100, 128 + 4),  # 4 blocks of 32: a byte each + an E8M0 byte per block
        (QuantSpec(scheme="mx", bits=6), 100, 96 + 4),  # 6 bits: 4 codes in 3 bytes
        (QuantSpec(scheme="mx", bits=4), 100, 64 + 4),
        (QuantSpec(scheme="mxint", bits=8), 100, 128 + 4),
        (QuantSpec(scheme="nvfp4", bits=4), 100, 56 + 7 + 4),  # 7 blocks of 16, an E4M3 byte each, fp32 per row
        (QuantSpec(scheme="mx", bits=4, rotation="hadamard"), 100, 64 + 4),  # rotation sends the same bytes
    ],
    ids=lambda v: v.label if isinstance(v, QuantSpec) else str(v),
)
def test_wire_bytes_counted_by_hand(spec: QuantSpec, cols: int, nbytes: int) -> None:
    assert codec_for(spec).wire_bytes(cols, spec.bits, spec.group_size) == nbytes
    buf = codec_for(spec).encode(torch.randn(2, cols), spec.bits, spec.group_size, rows=2, seed=None)
    assert buf.shape == (2, nbytes)


def test_registry_cases_cover_every_registered_codec(offset_scheme) -> None:
    """A codec registered at run time is a case of registry_specs with each of its widths."""
    got = {(s.scheme, s.bits) for s in registry_specs()}
    assert got >= {("int", 8), ("int", 4), ("fp8", 8), ("mx", 8), ("mx", 6), ("mx", 4), ("mxint", 8), ("nvfp4", 4)}
    assert ("offset", 8) in got


def test_codec_for_builds_one_variant_per_format_setting() -> None:
    e4, e5 = QuantSpec(scheme="mx", bits=8), QuantSpec(scheme="mx", bits=8, fp8_format="e5m2")
    assert codec_for(e4) is codec_for(QuantSpec(scheme="mx", bits=8, group_size=32))
    assert codec_for(e5) is codec_for(e5.replace()) and codec_for(e5) is not codec_for(e4)
    x = torch.linspace(-1000, 1000, 64)
    assert not torch.equal(
        codec_for(e4).encode(x, 8, 32, rows=1, seed=None), codec_for(e5).encode(x, 8, 32, rows=1, seed=None)
    )
    h = e5.replace(rotation="hadamard")
    assert codec_for(h) is codec_for(h.replace()) and codec_for(h).inner is codec_for(e5)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(scheme="mx", bits=4, group_size=64), "blocks of 32 elements fixed by its format; use group_size=32"),
        (dict(scheme="nvfp4", bits=4, group_size=32), "blocks of 16 elements fixed by its format; use group_size=16"),
        (dict(scheme="mx", bits=5), r"not supported by scheme 'mx'; use one of \(8, 6, 4\)"),
        (dict(bits=8, fp8_format="e5m2"), "fp8_format=e5m2 does nothing for scheme 'int' at bits 8"),
        (dict(scheme="mx", bits=4, fp6_format="e3m2"), "fp6_format=e3m2 does nothing for scheme 'mx' at bits 4"),
        (dict(scheme="fp8", bits=8, mx_scale="round_up"), "mx_scale=round_up does nothing for scheme 'fp8'"),
        (dict(scheme="fp8", bits=8, fp8_format="e4m4"), "fp8_format must be one of e4m3, e5m2"),
        (
            dict(scheme="mx", bits=4, rotation="hadamard", hadamard_block=64),
            "hadamard_block=64 does not divide group_size=32",
        ),
    ],
)
def test_format_spec_refusals(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        QuantSpec(**kw)


def test_every_format_is_labelled_as_the_benchmarks_name_it() -> None:
    """A run's label and bench_comm's format name (``format_name``: mxfp8, not mx8) agree for every
    registered scheme at each of its widths."""
    from zeropp.comm.spec import schemes
    from zeropp.experiments.projection.scaling import format_name

    for scheme, widths in schemes().items():
        for bits in widths:
            spec = QuantSpec(scheme=scheme, bits=bits)
            assert spec.label == format_name(spec, bits), (scheme, bits)


def test_format_spec_labels_and_fixed_group_sizes() -> None:
    assert QuantSpec(scheme="mx", bits=4).group_size == 32 and QuantSpec(scheme="nvfp4", bits=4).group_size == 16
    assert QuantSpec(scheme="mx", bits=4, intra_bits=8, fp8_format="e5m2").label == "mxfp8/4+e5m2"
    assert QuantSpec(scheme="fp8", bits=8, group_size=64).label == "fp8g64"
    assert QuantSpec(scheme="nvfp4", bits=4, rotation="hadamard").label == "nvfp4+had"
    assert QuantSpec(scheme="mx", bits=8, mx_scale="round_up").label == "mxfp8+round_up"
    with pytest.raises(ValueError, match="built-in scheme 'mx' cannot be unregistered"):
        unregister_codec("mx")
    with pytest.raises(ValueError, match="built-in scheme 'nvfp4' cannot be replaced"):
        register_codec("nvfp4", OffsetCodec(), bits=(4,))


def test_every_recipe_is_a_quant_option_and_the_formats_sweep_names_recipes() -> None:
    from pathlib import Path

    import yaml

    from zeropp.comm.spec import RECIPES
    from zeropp.experiments.runner.schema import group_options

    assert group_options()["quant"] == sorted(RECIPES)
    formats = {"fp8", "mxfp8", "mxfp6", "mxfp4", "nvfp4", "w_mxfp8_g_mxfp4", "sdp4bit_mx"}
    assert formats <= set(RECIPES)
    sweep = yaml.safe_load((Path(__file__).parents[2] / "conf" / "sweep" / "formats.yaml").read_text())
    quant = sweep["hydra"]["sweeper"]["params"]["quant"].split(",")
    assert set(quant) <= set(RECIPES) and formats <= set(quant) and {"w8g8", "w4g4"} <= set(quant)


FORMAT_SPECS = [s for s in registry_specs() + format_variants() if s.scheme != "int"]


@pytest.mark.parametrize("native", [True, False], ids=["native", "reference"])
@pytest.mark.parametrize("spec", FORMAT_SPECS, ids=spec_id)
def test_format_codecs_encode_straight_into_wire_rows_as_pack_of_quantize(
    spec: QuantSpec, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The float codecs' CPU ``encode`` writes codes into the wire rows themselves: bit for bit
    ``pack(quantize)``, for bf16 rows over several kernel tiles, a row length whose codes leave
    the fp32 scales unaligned (fp8) and an nvfp4 tensor scale at an odd offset, nearest and
    stochastic, with the kernels on and off (the reference path)."""
    from zeropp.kernels import cpu_format_library, cpu_formats, cpu_native

    if native and not cpu_formats.available():
        pytest.skip(f"native CPU format kernels unavailable here: {cpu_format_library.FAILED}")
    monkeypatch.setattr(cpu_native, "ENABLED", native)
    codec = codec_for(spec)
    gs = spec.group_size or 32
    g = torch.Generator().manual_seed(3)
    for rows, cols in ((3, 4100), (2, 75)):
        x = (torch.randn(rows, cols, generator=g) * 3).bfloat16()
        for seed in (None, 17):
            wire = codec.encode(x, spec.bits, gs, rows=rows, seed=seed)
            want = codec.pack(codec.quantize(x, spec.bits, gs, rows=rows, seed=seed))
            assert wire.dtype == torch.uint8 and wire.shape == (rows, codec.wire_bytes(cols, spec.bits, gs))
            assert torch.equal(wire, want)
