"""The codec registry: a scheme registered in a test reaches every collective unchanged.

Here: the one-process checks. The topic's full description and its gloo-world checks are in
``tests/distributed/test_comm_codecs.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.toy_codec import OffsetCodec
from zeropp.comm.codecs import Codec, IntCodec, codec_for, codecs, register_codec, unregister_codec
from zeropp.comm.spec import QuantSpec, register_scheme, schemes, unregister_scheme


@pytest.fixture
def offset_scheme():
    register_codec("offset", OffsetCodec(), bits=(8,))
    yield
    unregister_codec("offset")


def test_unregistered_scheme_fails_in_quantspec() -> None:
    with pytest.raises(ValueError, match=r"QuantSpec.scheme='hadamard' is not registered; use one of \['int'"):
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
