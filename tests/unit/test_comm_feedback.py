"""Error feedback on every quantized hop of qgZ, residuals stored in 8 bits (LoCo), their state for
checkpoints, and the spec / state agreement checks.

Here: the one-process checks. The topic's full description and its gloo-world checks are in
``tests/distributed/test_comm_feedback.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.comm_helpers import rank_input
from zeropp.comm import ErrorFeedback, QuantSpec
from zeropp.comm.backend import check_reduce_spec
from zeropp.kernels import dequantize, num_groups, quantize


# ------------------------------------------------------------------ single process: the state
@pytest.mark.parametrize("numel", [1, 7, 17 * 257])
def test_8bit_residuals_store_one_byte_per_element_and_round_trip(numel: int) -> None:
    x = rank_input(3, 0, numel, torch.float32) * 1e-3
    ef = ErrorFeedback(group_size=128)  # the default: 8 bits, groups of 128
    assert ef.residual_bits == 8
    ef.store("k", x)
    groups = num_groups(numel, 128)
    assert ef.nbytes() == groups * 128 + 4 * groups  # INT8 codes (padded to whole groups) + fp32 scales
    assert ef.nbytes() <= numel + 4 * groups + 127  # about 1 byte per element
    got = ef.residual("k", numel, torch.device("cpu"))
    assert got.dtype == torch.float32 and got.shape == (numel,)
    assert torch.equal(got, dequantize(quantize(x, 8, 128, rows=1)).view(-1))  # the kernels' INT8 round trip
    ax = x.abs().view(1, -1)
    bound = torch.nn.functional.pad(ax, (0, groups * 128 - numel)).view(groups, 128).amax(1).repeat_interleave(128)
    assert ((got - x).abs() <= bound[:numel] / 254 + 1e-12).all()  # half a step of the group's scale
    fp32 = ErrorFeedback(residual_bits=32)
    fp32.store("k", x)
    assert fp32.nbytes() == 4 * numel and torch.equal(fp32.residual("k", numel, torch.device("cpu")), x)


def test_8bit_residuals_drop_non_finite_values_and_check_sizes() -> None:
    ef = ErrorFeedback()
    ef.store("a", torch.tensor([1.0, float("nan"), float("inf"), -2.0]))
    got = ef.residual("a", 4, torch.device("cpu")).tolist()
    assert got[1:] == [0.0, 0.0, -2.0]  # non-finite -> 0; the group's absmax is an exact code
    assert abs(got[0] - 1.0) <= 2.0 / 127 / 2  # within half a step of the scale 2/127
    with pytest.raises(ValueError, match="bucket 'a' holds 4 elements but this call has 5"):
        ef.residual("a", 5, torch.device("cpu"))
    for bad in (16, 4, True, "8"):
        with pytest.raises(ValueError, match="residual_bits=.*use one of \\(8, 32\\)"):
            ErrorFeedback(residual_bits=bad)
    with pytest.raises(ValueError, match="group_size=0 must be a positive int"):
        ErrorFeedback(group_size=0)


@pytest.mark.parametrize("bits", [8, 32])
def test_state_dict_round_trip_and_conversion(bits: int) -> None:
    src = ErrorFeedback(residual_bits=bits)
    vals = {"b0:0": rank_input(4, 0, 7, torch.float32), "b1@hop2": rank_input(4, 1, 17 * 257, torch.float32)}
    for k, v in vals.items():
        src.store(k, v)
    sd = src.state_dict()
    fields = {name.rpartition("|")[2] for name in sd}
    assert fields == ({"fp32"} if bits == 32 else {"codes", "scales", "layout"})
    same = ErrorFeedback(residual_bits=bits)
    same.load_state_dict({k: v.clone() for k, v in sd.items()})
    assert same.keys() == src.keys() and same.nbytes() == src.nbytes()
    for k, v in vals.items():
        assert torch.equal(same.residual(k, v.numel(), v.device), src.residual(k, v.numel(), v.device))
    other = ErrorFeedback(residual_bits=40 - bits)  # 8 <-> 32: converted on load
    other.load_state_dict(sd)
    for k, v in vals.items():
        want = src.residual(k, v.numel(), v.device)
        if bits == 32:  # fp32 -> 8 bits: quantized like a store
            want = dequantize(quantize(want, 8, 128, rows=1)).view(-1)
        assert torch.equal(other.residual(k, v.numel(), v.device), want)
    with pytest.raises(ValueError, match="is not '<bucket>|<field>'"):
        same.load_state_dict({"nofield": torch.zeros(1)})
    with pytest.raises(ValueError, match="has fields"):
        same.load_state_dict({"k|codes": torch.zeros(1, dtype=torch.int8)})
    assert same.keys() == src.keys()  # a refused load changed nothing


def test_spec_residual_bits_and_agreement_with_the_state() -> None:
    assert QuantSpec(bits=4, error_feedback=True).residual_bits == 8
    assert QuantSpec(bits=4, error_feedback=True).label == "int4+ef"
    assert QuantSpec(bits=4, error_feedback=True, residual_bits=32).label == "int4+ef32"
    with pytest.raises(ValueError, match="residual_bits=16: .*use 8 or 32"):
        QuantSpec(bits=4, error_feedback=True, residual_bits=16)
    with pytest.raises(ValueError, match="residual_bits=32 does nothing without error feedback"):
        QuantSpec(bits=4, residual_bits=32)
    spec = QuantSpec(bits=4, error_feedback=True, residual_bits=32)
    assert ErrorFeedback.for_spec(spec).residual_bits == 32
    check_reduce_spec(spec, ErrorFeedback.for_spec(spec))
    with pytest.raises(ValueError, match="residual_bits=32 but the error_feedback state stores 8-bit residuals"):
        check_reduce_spec(spec, ErrorFeedback())
