"""The fp8 / MX / NVFP4 reference (kernels/format_reference.py) against hand-computed codes from the
OCP MX v1.0 tables, against torch's float8 casts where those agree with it, and on the awkward
inputs every implementation must survive (sizes, dtypes, zero and non-finite blocks, stochastic
rounding)."""

from __future__ import annotations

import types

import pytest
import torch

from tests.kernel_helpers import DTYPES, gaussian
from zeropp.kernels import format_ops
from zeropp.kernels.format_layout import (
    ELEMENTS,
    FormatTensor,
    bits_per_element,
    pack,
    pack_codes,
    unpack,
    unpack_codes,
    wire_bytes,
)
from zeropp.kernels.format_reference import (
    decode_e8m0,
    decode_elements,
    dequantize_fp8_ref,
    dequantize_mx_ref,
    dequantize_nvfp4_ref,
    encode_elements,
    quantize_fp8_ref,
    quantize_mx_ref,
    quantize_nvfp4_ref,
)

FLOAT8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def enc(values: list[float], elem: str) -> list[int]:
    return encode_elements(torch.tensor(values, dtype=torch.float32), elem).tolist()


# ----------------------------------------------------------------------------------------------
# Elements: hand-computed codes.
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "elem, values, codes",
    [
        # max normal, min normal, min subnormal, 1.0, signs
        ("e4m3", [448.0, 2**-6, 2**-9, 1.0, -1.0, -448.0], [0x7E, 0x08, 0x01, 0x38, 0xB8, 0xFE]),
        ("e5m2", [57344.0, 2**-14, 2**-16, 1.0, -2.0], [0x7B, 0x04, 0x01, 0x3C, 0xC0]),
        ("e3m2", [28.0, 0.25, 0.0625, 1.0, -28.0], [0x1F, 0x04, 0x01, 0x0C, 0x3F]),
        ("e2m3", [7.5, 1.0, 0.125, 0.875, -7.5], [0x1F, 0x08, 0x01, 0x07, 0x3F]),
        ("e2m1", [6.0, 1.0, 0.5, 4.0, -6.0, -0.5], [0x7, 0x2, 0x1, 0x6, 0xF, 0x9]),
        ("int8", [1.0, -1.0, 127 / 64, 1 / 64, -127 / 64], [64, 0xC0, 127, 1, 0x81]),
    ],
)
def test_codes_match_the_ocp_tables(elem, values, codes):
    assert enc(values, elem) == codes
    assert decode_elements(torch.tensor(codes), elem).tolist() == values


@pytest.mark.parametrize(
    "elem, values, codes",
    [
        # halfway between two codes -> the even mantissa
        ("e4m3", [1.0625, 1.1875, 2**-10, 3 * 2**-10], [0x38, 0x3A, 0x00, 0x02]),
        ("e2m1", [2.5, 3.5, 5.0, 0.25, 0.75], [0x4, 0x6, 0x6, 0x0, 0x2]),
        ("e5m2", [1.125, 1.375], [0x3C, 0x3E]),
        ("int8", [0.5 / 64, 1.5 / 64, -0.5 / 64], [0, 2, 0]),
        # rounding up into the next binade
        ("e4m3", [0.99], [0x38]),
        ("e2m3", [1.96875], [0x10]),
    ],
)
def test_halfway_rounds_to_even_and_carries_into_the_next_binade(elem, values, codes):
    assert enc(values, elem) == codes


@pytest.mark.parametrize("elem", list(ELEMENTS))
def test_saturation_and_non_finite(elem):
    f = ELEMENTS[elem]
    top = enc([f.max], elem)[0]
    assert enc([f.max * 1.01, 1e30, float("inf")], elem) == [top] * 3
    assert decode_elements(torch.tensor(enc([-float("inf")], elem)), elem).item() == -f.max
    nan = enc([float("nan")], elem)[0]
    assert nan == (f.nan_code if f.nan_code is not None else 0)
    if f.nan_code is not None:
        assert torch.isnan(decode_elements(torch.tensor([nan]), elem)).all()


def test_signed_zero_keeps_its_sign_bit_except_int8():
    assert enc([-0.0, -1e-30, 0.0], "e4m3") == [0x80, 0x80, 0x00]
    assert enc([-0.0, -1e-30], "e2m1") == [0x8, 0x8]
    assert enc([-0.0, -1e-30], "int8") == [0, 0]


@pytest.mark.parametrize("elem", list(ELEMENTS))
def test_every_finite_code_round_trips(elem):
    f = ELEMENTS[elem]
    codes = torch.arange(2**f.bits)
    vals = decode_elements(codes, elem)
    keep = torch.isfinite(vals) & (vals.abs() <= f.max)
    assert torch.equal(encode_elements(vals[keep], elem), codes[keep].to(torch.int32))
    assert vals[keep].abs().max().item() == f.max


@pytest.mark.parametrize("elem", list(FLOAT8))
def test_fp8_elements_agree_with_torch_float8_casts(elem):
    """torch's casts round to nearest-even like the reference; only saturation differs, so the
    comparison clamps first. Covers subnormals, halfway points and every binade."""
    f = ELEMENTS[elem]
    grid = decode_elements(torch.arange(256), elem)
    grid = grid[torch.isfinite(grid) & (grid.abs() <= f.max)]
    s = grid.sort().values
    probes = torch.cat([s, (s[:-1] + s[1:]) / 2, gaussian(20000, 3) * f.max / 4, gaussian(2000, 4) * 2.0**-8])
    probes = probes.clamp(-f.max, f.max)
    torch_codes = probes.to(FLOAT8[elem]).view(torch.uint8).to(torch.int32)
    assert torch.equal(encode_elements(probes, elem), torch_codes)
    assert torch.equal(
        decode_elements(torch.arange(256), elem).nan_to_num(7.0),
        torch.arange(256).to(torch.uint8).view(FLOAT8[elem]).float().nan_to_num(7.0),
    )


def test_e8m0_decode():
    assert decode_e8m0(torch.tensor([127, 119, 0, 254])).tolist() == [1.0, 2.0**-8, 2.0**-127, 2.0**127]
    assert torch.isnan(decode_e8m0(torch.tensor([255]))).all()


# ----------------------------------------------------------------------------------------------
# Schemes.
# ----------------------------------------------------------------------------------------------
def test_mx_scale_of_a_unit_block_is_two_to_minus_eight():
    x = torch.linspace(-1, 1, 32)
    assert quantize_mx_ref(x, "e4m3").scales.tolist() == [[119]]  # 2**-8 = 2**(0 - emax 8)
    assert quantize_mx_ref(x, "e4m3", scale_rule="round_up").scales.tolist() == [[119]]
    assert quantize_mx_ref(x, "e2m1").scales.tolist() == [[125]]  # emax 2
    assert quantize_mx_ref(x, "int8").scales.tolist() == [[127]]  # emax 0


def test_mx_round_up_rule_never_saturates():
    x = torch.zeros(32)
    x[0] = 500.0  # floor(log2 500) = 8: OCP scale 1, 500 saturates to 448; round_up scale 2
    ocp, up = quantize_mx_ref(x, "e4m3"), quantize_mx_ref(x, "e4m3", scale_rule="round_up")
    assert ocp.scales.item() == 127 and up.scales.item() == 128
    assert dequantize_mx_ref(ocp)[0, 0].item() == 448.0
    assert dequantize_mx_ref(up)[0, 0].item() == 512.0  # 250 -> e4m3 256 (nearest), times 2


@pytest.mark.parametrize("scheme", ["fp8", "mx", "nvfp4"])
def test_zero_and_non_finite_blocks(scheme):
    gs = {"fp8": 64, "mx": 32, "nvfp4": 16}[scheme]
    x = gaussian(4 * gs)
    x[:gs] = 0.0
    x[gs + 3] = float("nan")
    x[2 * gs + 5] = -float("inf")
    q = quantize(scheme, x, gs)
    y = dequantize(q)[0]
    assert torch.equal(y[:gs], torch.zeros(gs))
    assert torch.isnan(y[gs : 3 * gs]).all()
    assert torch.isfinite(y[3 * gs :]).all()
    assert (unpack_codes(q.codes, ELEMENTS[q.elem].bits)[0, gs : 3 * gs] == 0).all()
    if scheme == "mx":
        assert q.scales[0].tolist()[:3] == [0, 255, 255]
    elif scheme == "nvfp4":
        assert q.scales[0].tolist()[1:3] == [0x7F, 0x7F]
    else:
        assert q.scales[0, 0].item() == 0 and torch.isnan(q.scales[0, 1:3]).all()


def quantize(scheme: str, x: torch.Tensor, gs: int, *, elem: str | None = None, rows: int = 1, **kw) -> FormatTensor:
    if scheme == "fp8":
        return quantize_fp8_ref(x, elem or "e4m3", gs, rows=rows, **kw)
    if scheme == "mx":
        return quantize_mx_ref(x, elem or "e4m3", rows=rows, **kw)
    return quantize_nvfp4_ref(x, rows=rows, **kw)


def dequantize(q: FormatTensor, **kw) -> torch.Tensor:
    fn = {"fp8": dequantize_fp8_ref, "mx": dequantize_mx_ref, "nvfp4": dequantize_nvfp4_ref}[q.scheme]
    return fn(q, **kw)


@pytest.mark.parametrize("elem", list(FLOAT8))
def test_fp8_scheme_agrees_with_a_torch_cast_of_the_scaled_group(elem):
    x = gaussian(17 * 257, 5).view(17, 257) * 3
    q = quantize_fp8_ref(x, elem, 64, rows=17)
    pad = torch.zeros(17, 320)
    pad[:, :257] = x
    s = pad.view(17, 5, 64).abs().amax(-1) / ELEMENTS[elem].max
    v = (pad.view(17, 5, 64) / s.unsqueeze(-1)).clamp(-ELEMENTS[elem].max, ELEMENTS[elem].max)
    want = v.to(FLOAT8[elem]).view(torch.uint8).view(17, 320)
    assert torch.equal(q.codes, want)
    assert torch.equal(q.scales, s)


@pytest.mark.parametrize("elem", list(FLOAT8))
def test_mx_scheme_agrees_with_a_torch_cast_of_the_scaled_block(elem):
    x = gaussian(7 * 96, 6).view(7, 96) * torch.logspace(-3, 3, 96)
    q = quantize_mx_ref(x, elem, rows=7)
    k = q.scales.to(torch.int32) - 127
    v = x.view(7, 3, 32) * torch.pow(2.0, -k.float()).unsqueeze(-1)
    want = v.clamp(-ELEMENTS[elem].max, ELEMENTS[elem].max).to(FLOAT8[elem]).view(torch.uint8).view(7, 96)
    assert torch.equal(q.codes, want)


def test_nvfp4_hand_computed_block():
    x = torch.tensor([6.0, -3.0, 1.0, 0.5] + [0.0] * 12 + [0.75] + [0.0] * 15)
    q = quantize_nvfp4_ref(x)
    t = torch.tensor(6.0) / torch.tensor(2688.0)
    assert q.tensor_scales.item() == t.item()
    b0 = encode_elements(torch.tensor(6.0) / 6 / t, "e4m3").item()
    b1 = encode_elements(torch.tensor(0.75) / 6 / t, "e4m3").item()
    assert q.scales[0].tolist() == [b0, b1] and b0 == 0x7E  # 448, the E4M3 max
    y = dequantize_nvfp4_ref(q)[0]
    d0 = decode_elements(torch.tensor(b0), "e4m3") * t
    want = decode_elements(encode_elements(x[:16] / d0, "e2m1"), "e2m1") * d0
    assert torch.equal(y[:16], want)
    assert torch.allclose(y, x, rtol=0.02, atol=0)


@pytest.mark.parametrize(
    "scheme, elem",
    [
        ("fp8", "e4m3"),
        ("fp8", "e5m2"),
        ("mx", "e4m3"),
        ("mx", "e5m2"),
        ("mx", "e3m2"),
        ("mx", "e2m3"),
        ("mx", "e2m1"),
        ("mx", "int8"),
        ("nvfp4", "e2m1"),
    ],
)
@pytest.mark.parametrize("shape, rows", [((1,), 1), ((7,), 1), ((17, 257), 17), ((3, 100), 3)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_shapes_dtypes_and_relative_error(scheme, elem, shape, rows, dtype):
    """Any size pads to whole blocks; bf16/fp16 inputs quantize as their exact fp32 widening; the
    error stays within half a step of the element grid (relative to the block's largest value)."""
    gs = 48 if scheme == "fp8" else None
    x = (gaussian(int(torch.tensor(shape).prod()), 7) * 2).view(shape).to(dtype)
    q = quantize(scheme, x, gs or 0, elem=elem, rows=rows)
    q32 = quantize(scheme, x.float(), gs or 0, elem=elem, rows=rows)
    assert torch.equal(q.codes, q32.codes) and torch.equal(q.scales, q32.scales)
    assert pack(q).shape == (rows, wire_bytes(scheme, elem, x.numel() // rows, q.group_size))
    y = dequantize(q, dtype=dtype)
    assert y.dtype == dtype and y.shape == (rows, x.numel() // rows)
    f = ELEMENTS[elem]
    rel = 2.0 ** -(f.mbits + 1) if not f.is_int else 2.0**-6
    err = (y.float() - x.float().view(rows, -1)).abs()
    bound = x.float().abs().max() * rel * 2.5 + (1e-2 if dtype != torch.float32 else 0) * x.float().abs().max()
    assert err.max() <= bound


@pytest.mark.parametrize("scheme, elem", [("fp8", "e4m3"), ("mx", "e2m1"), ("mx", "int8"), ("nvfp4", "e2m1")])
def test_stochastic_rounding_is_unbiased_and_deterministic(scheme, elem):
    x = gaussian(256, 8)
    gs = 64 if scheme == "fp8" else 0
    runs = torch.stack([dequantize(quantize(scheme, x, gs, elem=elem, stochastic=True, seed=s))[0] for s in range(400)])
    near = dequantize(quantize(scheme, x, gs, elem=elem))[0]
    # the mean over seeds sits much closer to x than round-to-nearest does
    assert (runs.mean(0) - x).abs().mean() < 0.25 * (near - x).abs().mean()
    a = quantize(scheme, x, gs, elem=elem, stochastic=True, seed=11)
    b = quantize(scheme, x, gs, elem=elem, stochastic=True, seed=11)
    c = quantize(scheme, x, gs, elem=elem, stochastic=True, seed=12)
    assert torch.equal(a.codes, b.codes) and not torch.equal(a.codes, c.codes)


# ----------------------------------------------------------------------------------------------
# Layout: packing, wire bytes, refusals.
# ----------------------------------------------------------------------------------------------
def test_sub_byte_packing_order():
    assert pack_codes(torch.tensor([1, 2, 3, 4]), 6).tolist() == [0x81, 0x30, 0x10]  # w = 0x103081
    assert pack_codes(torch.tensor([0x3, 0xC]), 4).tolist() == [0xC3]
    for bits in (4, 6, 8):
        c = torch.randint(0, 2**bits, (3, 64))
        assert torch.equal(unpack_codes(pack_codes(c, bits), bits), c.to(torch.int32))


@pytest.mark.parametrize(
    "scheme, elem, gs, bpe",
    [
        ("mx", "e4m3", 32, 8.25),
        ("mx", "e3m2", 32, 6.25),
        ("mx", "e2m1", 32, 4.25),
        ("nvfp4", "e2m1", 16, 4.5),
        ("fp8", "e4m3", 128, 8.25),
    ],
)
def test_wire_bits_per_element(scheme, elem, gs, bpe):
    assert bits_per_element(scheme, elem, gs) == bpe + (32 / gs if scheme == "nvfp4" else 0)
    assert wire_bytes("nvfp4", "e2m1", 1600, 16) == 800 + 100 + 4


@pytest.mark.parametrize("scheme", ["fp8", "mx", "nvfp4"])
def test_pack_unpack_round_trip_with_leading_dims(scheme):
    x = gaussian(3 * 100, 9).view(3, 100)
    q = quantize(scheme, x, 40, rows=3)
    buf = pack(q)
    stacked = torch.stack([buf, buf])  # [k, rows, B]
    back = unpack(stacked, scheme, q.elem, 100, q.group_size)
    assert back.codes.shape[:2] == (2, 3)
    one = unpack(buf[1:2], scheme, q.elem, 100, q.group_size)  # an unaligned slice of the buffer
    assert torch.equal(dequantize(one), dequantize(q)[1:2])


def test_refusals_are_clear():
    x = torch.ones(64)
    with pytest.raises(ValueError, match="blocks of 32 elements fixed by the format"):
        unpack(torch.zeros(1, 40, dtype=torch.uint8), "mx", "e4m3", 32, 64)
    with pytest.raises(ValueError, match="not one of scheme 'fp8'"):
        quantize_fp8_ref(x, "e2m1", 32)
    with pytest.raises(ValueError, match="scale rule"):
        quantize_mx_ref(x, "e4m3", scale_rule="up")
    with pytest.raises(ValueError, match="dtype"):
        quantize_mx_ref(x.double(), "e4m3")
    with pytest.raises(ValueError, match="takes a mx FormatTensor"):
        dequantize_mx_ref(quantize_nvfp4_ref(x))
    with pytest.raises(ValueError, match="wire rows"):
        unpack(torch.zeros(1, 3, dtype=torch.uint8), "mx", "e4m3", 32, 32)


# ----------------------------------------------------------------------------------------------
# The dispatcher.
# ----------------------------------------------------------------------------------------------
def test_dispatcher_prefers_the_fast_module_and_falls_back_to_the_reference(monkeypatch):
    x = gaussian(64)
    fake = types.ModuleType("zeropp.kernels.cpu_formats")
    calls = []

    def quantize_mx(x, elem, **kw):
        calls.append(elem)
        return quantize_mx_ref(x, elem, **kw)

    fake.quantize_mx = quantize_mx  # type: ignore[attr-defined]
    monkeypatch.setattr(format_ops, "_loaded", {"torch": fake})
    format_ops.quantize_mx(x, "e2m1")
    assert calls == ["e2m1"]
    format_ops.quantize_mx(x, "e2m1", impl="reference")
    assert calls == ["e2m1"]
    q = format_ops.quantize_nvfp4(x)  # not in the fake module: the reference
    assert torch.equal(format_ops.dequantize_format(q), dequantize_nvfp4_ref(q))
    with pytest.raises(ValueError, match="impl must be one of"):
        format_ops.quantize_nvfp4(x, impl="cuda")


def test_dispatcher_raises_when_a_fast_module_is_broken(monkeypatch):
    """An absent fast module falls back to the reference; one whose own imports fail raises."""

    def absent(name):
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    def broken(name):
        raise ModuleNotFoundError("No module named 'triton'", name="triton")

    monkeypatch.setattr(format_ops, "_loaded", {})
    monkeypatch.setattr(format_ops.importlib, "import_module", absent)
    assert format_ops.implementation("quantize_mx", torch.device("cpu"), "triton") is quantize_mx_ref
    monkeypatch.setattr(format_ops, "_loaded", {})
    monkeypatch.setattr(format_ops.importlib, "import_module", broken)
    with pytest.raises(ModuleNotFoundError, match="triton"):
        format_ops.quantize_mx(gaussian(32), "e4m3", impl="triton")
