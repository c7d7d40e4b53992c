"""The quantized collectives make no copies around the collective itself.

Here: the one-process checks. The topic's full description and its gloo-world checks are in
``tests/distributed/test_comm_zero_copy.py``; its CUDA checks are in
``tests/gpu/test_comm_zero_copy.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.comm_helpers import generic_encode
from tests.kernel_helpers import DTYPES
from tests.triton_helpers import interpreted
from zeropp.comm.codecs import Codec, IntCodec, wire_layout
from zeropp.kernels import QuantizedTensor, dequantize, quantize
from zeropp.kernels.reference import dequantize_ref, quantize_ref

SIZES = [(1, 1), (1, 7), (17, 257)]


# ----------------------------------------------------------------------------------------------
# Parity of the in-place wire path with the generic pack / unpack path (no process group needed)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows,cols", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("seed", [None, 1234])
def test_int_encode_in_place_matches_pack(rows, cols, dtype, bits, seed) -> None:
    c = IntCodec()
    x = (torch.randn(rows, cols) * 3).to(dtype)
    for gs in (8, 128, 6):  # 6 at INT4: 3 code bytes per block, not viewable in place for odd block counts
        buf = c.encode(x, bits, gs, rows=rows, seed=seed)
        assert buf.dtype == torch.uint8 and buf.shape == (rows, c.wire_bytes(cols, bits, gs))
        assert torch.equal(buf, generic_encode(c, x, bits, gs, rows, seed))
        q = c.unpack(buf, cols, bits, gs)
        if wire_layout(cols, bits, gs).in_place:  # views of the buffer, no unpack copy
            assert q.codes.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
            assert q.scales.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        ref = QuantizedTensor(q.codes.contiguous(), q.scales.contiguous(), cols, bits, gs)
        for out_dtype in DTYPES:
            got = c.dequantize(q, dtype=out_dtype)
            assert torch.equal(got, dequantize_ref(ref, dtype=out_dtype).view(rows, cols))


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [None, 99])
def test_swizzled_view_quantizes_like_the_swizzled_copy(dtype, seed) -> None:
    """qgZ's swizzle as indexing: quantizing the ``[rpn, nodes, n]`` view of the input straight
    into the send buffer gives the bytes of quantizing the materialised swizzled copy."""
    from zeropp.comm.qgz import swizzle, swizzled_view

    nodes, rpn, n = 2, 3, 257
    x = torch.randn(nodes * rpn, n).to(dtype)
    c = IntCodec()
    for bits in (8, 4):
        got = c.encode(swizzled_view(x, nodes, rpn), bits, 128, rows=nodes * rpn, seed=seed)
        want = generic_encode(c, swizzle(x, nodes, rpn), bits, 128, nodes * rpn, seed)
        assert torch.equal(got, want)
        # the same through the Triton kernels (interpreter on CPU), which index the view in place
        lay = wire_layout(n, bits, 128)
        buf, q = lay.empty(nodes * rpn, x.device)
        quantize(
            swizzled_view(x, nodes, rpn),
            bits,
            128,
            rows=nodes * rpn,
            stochastic=seed is not None,
            seed=seed or 0,
            out=q,
            impl="triton",
        )
        assert torch.equal(buf, want)


@pytest.mark.parametrize("impl", [pytest.param("triton", marks=interpreted), "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_writes_row_strided_columns_in_place(impl, dtype) -> None:
    """Received rows dequantized straight into columns ``[a:b]`` of a ``[W, S]`` buffer (the
    engine's bucketed all-gather): the caller's storage is written, nothing around it."""
    W, S, a, b, gs = 3, 300, 17, 17 + 257, 8
    x = torch.randn(W, b - a)
    for bits in (8, 4):
        lay = wire_layout(b - a, bits, gs)
        _buf, q = lay.empty(W, x.device)
        quantize(x, bits, gs, rows=W, out=q, impl=impl)
        full = torch.full((W, S), 7.0, dtype=dtype)
        ptr = full.data_ptr()
        dst = full[:, a:b]
        assert dequantize(q, out=dst, impl=impl) is dst and full.data_ptr() == ptr
        ref = dequantize_ref(quantize_ref(x, bits, gs, rows=W), dtype=dtype).view(W, b - a)
        assert torch.equal(full[:, a:b], ref)
        assert (full[:, :a] == 7).all() and (full[:, b:] == 7).all()


@pytest.mark.parametrize("impl", [pytest.param("triton", marks=interpreted), "torch"])
def test_quantize_reads_row_strided_columns_in_place(impl) -> None:
    """Columns of a wider buffer (the engine's bucketed reduce-scatter input), rows long enough
    for the CPU path's row-by-row reading, quantized into a wire buffer: the reference's bytes."""
    from zeropp.kernels.quantize import ROW_LOOP_MIN_COLS

    W, cols, gs = 3, ROW_LOOP_MIN_COLS + 7, 128
    wide = torch.randn(W, cols + 50).to(torch.bfloat16)
    x = wide[:, 20 : 20 + cols]  # [W, cols] row-strided view
    for bits in (8, 4):
        lay = wire_layout(cols, bits, gs)
        buf, q = lay.empty(W, x.device)
        quantize(x, bits, gs, rows=W, out=q, impl=impl)
        assert torch.equal(buf, Codec.encode(IntCodec(), x.contiguous(), bits, gs, rows=W, seed=None))
