"""Hadamard-rotated quantization in the codec and the collectives (``QuantSpec.rotation``).

Here: the one-process checks. The topic's full description and its gloo-world checks are in
``tests/distributed/test_comm_hadamard.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.comm_helpers import rank_input
from tests.hadamard_reference import had, q_rot, round_trip, unrot
from tests.kernel_helpers import stack
from zeropp.comm.codecs import HadamardCodec, IntCodec, codec_for
from zeropp.comm.spec import RECIPES, QuantSpec
from zeropp.kernels.reference import dequantize_sum_ref, dequantize_sum_requantize_ref


# ------------------------------------------------------------------------------ spec and recipe
def test_spec_validates_rotation_and_says_what_to_change() -> None:
    assert QuantSpec(bits=4, rotation="hadamard").label == "int4+had"
    assert had(4, 96, 32).label == "int4g96+had32"
    with pytest.raises(ValueError, match=r"QuantSpec.rotation='rot'; use one of \('none', 'hadamard'\)"):
        QuantSpec(bits=4, rotation="rot")
    with pytest.raises(ValueError, match=r"hadamard_block=8 is set but rotation='none'; set rotation='hadamard'"):
        QuantSpec(bits=4, hadamard_block=8)
    with pytest.raises(ValueError, match=r"hadamard_block=3 must be a power of two"):
        had(4, 64, 3)
    with pytest.raises(ValueError, match=r"group_size=96 elements, which is not a power of two.*e\.g\. 32"):
        had(4, 96)
    with pytest.raises(ValueError, match=r"hadamard_block=64 does not divide group_size=96.*use hadamard_block=32"):
        had(4, 96, 64)
    with pytest.raises(ValueError, match="odd group size"):
        had(8, 7)
    assert had(8, 6, 2).rotation_block(6) == 2 and QuantSpec(bits=8).rotation_block(128) is None
    # group_size=None: the block is resolved against the use's default group size when it runs
    spec = QuantSpec(bits=4, rotation="hadamard", hadamard_block=256)
    assert spec.rotation_block(512) == 256
    with pytest.raises(ValueError, match="hadamard_block=256 does not divide group_size=128"):
        spec.rotation_block(128)


def test_w4g4h_recipe_and_runner_group() -> None:
    r = RECIPES["w4g4h"]
    assert r.weights == QuantSpec(bits=4) and r.grads == QuantSpec(bits=4, rotation="hadamard")  # SDP4Bit's placement
    assert not r.hpz and RECIPES["w4g4"].grads == r.grads.replace(rotation="none")
    from zeropp.experiments.runner.schema import group_options

    assert "w4g4h" in group_options()["quant"]


def test_codec_for_wraps_the_int_codec_once_per_block() -> None:
    c = codec_for(had(4, 64))
    assert isinstance(c, HadamardCodec) and isinstance(c.inner, IntCodec) and c.in_place
    assert codec_for(had(8, 64)) is c  # cached: the engine asks per chunk
    assert codec_for(had(4, 64, 16)) is not c and codec_for(had(4, 64, 16)).block == 16
    assert isinstance(codec_for(QuantSpec(bits=4)), IntCodec)


# ------------------------------------------------------------------------------ codec, one process
# (cols, bits, group size, block): awkward lengths; a block smaller than the group; a group size
# that is not a power of two; a layout whose scales cannot be viewed in place (5 cols at INT8, g2)
CASES = [(1, 4, 16, None), (7, 8, 8, 4), (37, 4, 16, None), (257, 8, 96, 32), (257, 4, 128, None), (5, 8, 2, None)]


@pytest.mark.parametrize("cols, bits, gs, block", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_codec_matches_reference_composition(cols, bits, gs, block, dtype) -> None:
    c, ic = codec_for(had(bits, gs, block)), IntCodec()
    b = gs if block is None else block
    rows = 3
    x = rank_input(3, cols, rows * cols, torch.float32).to(dtype).view(rows, cols)
    assert c.wire_bytes(cols, bits, gs) == ic.wire_bytes(cols, bits, gs)  # bytes unchanged
    for seed in (None, 5):
        buf = c.encode(x, bits, gs, rows=rows, seed=seed)
        assert buf.shape == (rows, ic.wire_bytes(cols, bits, gs)) and buf.dtype == torch.uint8
        want_q = q_rot(x, b, bits, gs, rows, seed)
        q = c.unpack(buf, cols, bits, gs)
        assert q.cols == cols and torch.equal(q.codes, want_q.codes) and torch.equal(q.scales, want_q.scales)
        q2 = c.quantize(x, bits, gs, rows=rows, seed=seed)
        assert torch.equal(c.pack(q2), buf)
        for out_dtype in (torch.float32, dtype):
            assert torch.equal(c.dequantize(q, dtype=out_dtype), round_trip(x, b, bits, gs, rows, seed, out_dtype))
    # reductions over k = 2 stacked sources: sum rotated, rotate back once; re-quantize rotated
    y = rank_input(4, cols, rows * cols, torch.float32).to(dtype)
    bufs = torch.stack([c.encode(x, bits, gs, rows=rows, seed=None), c.encode(y, bits, gs, rows=rows, seed=None)])
    stacked = stack([q_rot(x, b, bits, gs, rows), q_rot(y, b, bits, gs, rows)])
    assert torch.equal(c.dequantize_sum(bufs, cols, bits, gs), unrot(dequantize_sum_ref(stacked), b, cols))
    assert torch.equal(
        c.dequantize_sum(bufs, cols, bits, gs, dtype=torch.bfloat16),
        unrot(dequantize_sum_ref(stacked), b, cols, torch.bfloat16),
    )
    for seed in (None, 9):
        send = c.dequantize_sum_requantize(bufs, cols, bits, gs, out_bits=4 if gs % 2 == 0 else 8, seed=seed)
        kw = {} if seed is None else dict(stochastic=True, seed=seed)
        want = dequantize_sum_requantize_ref(stacked, 4 if gs % 2 == 0 else 8, gs, **kw)
        got = c.unpack(send, cols, want.bits, gs)
        assert torch.equal(got.codes, want.codes) and torch.equal(got.scales, want.scales)


def test_codec_reads_swizzled_views_and_writes_row_strided_out() -> None:
    """What qgZ and the engine's bucketed gathers hand an in-place codec."""
    c = codec_for(had(4, 16))
    x = rank_input(6, 0, 4 * 37, torch.float32).view(2, 2, 37)  # [nodes, rpn, n]
    view = x.transpose(0, 1)  # [rpn, nodes, n], qgZ's swizzled order, not contiguous
    buf = c.encode(view, 4, 16, rows=4, seed=None)
    assert torch.equal(buf, c.encode(view.contiguous(), 4, 16, rows=4, seed=None))
    big = torch.zeros(4, 50)
    c.dequantize(c.unpack(buf, 37, 4, 16), out=big[:, 3:40])
    assert torch.equal(big[:, 3:40], round_trip(view.contiguous(), 16, 4, 16, rows=4))
    assert not big[:, :3].any() and not big[:, 40:].any()


def test_rotation_is_not_a_no_op_and_errors_at_use() -> None:
    x = rank_input(7, 0, 256, torch.float32)
    assert not torch.equal(
        codec_for(had(4, 64)).encode(x, 4, 64, rows=1, seed=None), IntCodec().encode(x, 4, 64, rows=1, seed=None)
    )
    c = codec_for(QuantSpec(bits=4, rotation="hadamard", hadamard_block=256))
    with pytest.raises(ValueError, match="hadamard_block=256 does not divide group_size=128"):
        c.encode(x, 4, 128, rows=1, seed=None)  # the gradients' default group size
