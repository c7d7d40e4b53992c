"""The collectives debug mode's parts that need no world (``zeropp.comm.callcheck``): the
fingerprint of a call, the comparison every rank makes of the gathered fingerprints, the
exchange's control flow (with the exchange itself faked), and how the mode is switched on.
The mode on a real gloo world: ``tests/distributed/test_comm_callcheck.py``."""

from __future__ import annotations

import pytest
import torch

from zeropp.comm import CommSession, QuantSpec, Topology, callcheck, context
from zeropp.comm.callcheck import agreed, disagreement, fingerprint

Q8 = QuantSpec(bits=8)


def _fp(n: int = 1000, spec=Q8, **extra) -> dict:
    return dict(fingerprint("quantized_all_gather", [0, 1], n, spec=spec), **extra)


def _agreed(n: int = 1000):
    """This rank's side of a quantized all-gather of ``n`` elements, with the check on."""
    return agreed(True, None, "quantized_all_gather", [0, 1], n, spec=Q8)


def test_same_calls_agree() -> None:
    assert disagreement([_fp(), _fp()]) is None
    assert disagreement([_fp(spec=None, dtype="float32")] * 3) is None


def test_a_different_count_names_every_rank_and_the_fix() -> None:
    msg = disagreement([_fp(1000), _fp(1024)])
    assert msg is not None
    assert msg.startswith("quantized_all_gather: the ranks of its group ([0, 1]) made different calls")
    assert "n: rank 0: 1000, rank 1: 1024" in msg
    assert "pad every rank's tensor to the largest, 1024 elements" in msg
    assert "ZEROPP_DEBUG_COLLECTIVES=1" in msg


def test_specs_are_compared_field_by_field() -> None:
    a = _fp(spec=QuantSpec(bits=8, group_size=256))
    b = _fp(spec=QuantSpec(bits=4, group_size=256))
    msg = disagreement([a, b])
    assert msg is not None and "spec.bits: rank 0: 8, rank 1: 4" in msg and "group_size" not in msg
    msg = disagreement([_fp(spec=None), _fp(spec=QuantSpec(bits=8, scheme="fp8"))])
    assert msg is not None and "spec: rank 0: None (plain), rank 1: QuantSpec(bits=8, " in msg
    assert "scheme='fp8'" in msg and "pass one QuantSpec on every rank" in msg


def test_fields_added_by_the_call_are_compared() -> None:
    msg = disagreement([_fp(op="avg", topology="2x2"), _fp(op="premul_sum(0.5)", topology="1x4")])
    assert msg is not None
    assert "op: rank 0: 'avg', rank 1: 'premul_sum(0.5)'" in msg and "pass one reduce op" in msg
    assert "topology: rank 0: '2x2', rank 1: '1x4'" in msg and "the same Topology" in msg
    assert callcheck.op_name("premul_sum", 0.5) == "premul_sum(0.5)" and callcheck.op_name("sum", 1.0) == "sum"
    assert callcheck.topology_name(Topology(2, 4, tp=2)) == "2x4 tp=2"
    assert callcheck.dtype_name(torch.bfloat16) == "bfloat16"


def test_ranks_are_named_by_their_global_rank_when_the_group_agrees() -> None:
    a, b = (dict(fingerprint("all_reduce", [2, 3], n)) for n in (8, 9))
    assert "n: rank 2: 8, rank 3: 9" in (disagreement([a, b]) or "")
    b["ranks"] = [3, 2]
    assert "n: rank 0: 8, rank 1: 9" in (disagreement([a, b]) or "")  # groups differ: group ranks


def test_the_check_off_builds_nothing_and_exchanges_nothing(monkeypatch) -> None:
    monkeypatch.setattr(callcheck, "all_gather_json", _never)
    with agreed(False, None, "quantized_all_gather", [0, 1], 8) as fp:
        assert fp == {}
    with pytest.raises(ValueError, match="local"), agreed(False, None, "quantized_all_gather", [0, 1], 8):
        raise ValueError("local")


def _never(*args, **kwargs):
    raise AssertionError("no exchange may run with the check off")


def _peers(*others: dict):
    """A fake exchange: this rank's fingerprint first, then ``others``."""

    def exchange(fp: dict, group) -> list[dict]:
        return [fp, *others]

    return exchange


def test_a_mismatch_raises_after_the_checks(monkeypatch) -> None:
    monkeypatch.setattr(callcheck, "all_gather_json", _peers(_fp(1024)))
    with pytest.raises(ValueError, match=r"n: rank 0: 1000, rank 1: 1024"), _agreed():
        pass
    monkeypatch.setattr(callcheck, "all_gather_json", _peers(_fp(1000, dtype="float32")))
    with _agreed() as fp:
        fp["dtype"] = "float32"  # fields the body adds take part


def test_a_local_error_is_exchanged_then_raised(monkeypatch) -> None:
    sent: list[dict] = []

    def exchange(fp: dict, group) -> list[dict]:
        sent.append(fp)
        return [fp, _fp()]

    monkeypatch.setattr(callcheck, "all_gather_json", exchange)
    with pytest.raises(TypeError, match="bad spec"), _agreed():  # this rank's own error, unchanged
        raise TypeError("bad spec")
    assert sent[0]["error"] == "TypeError: bad spec"  # the peers were told, so they do not wait
    # a peer's error: this rank names it instead of going on to a collective nobody joins
    monkeypatch.setattr(callcheck, "all_gather_json", _peers(_fp(error="ValueError: output too small")))
    refused = r"other ranks of the group refused this call \(rank 1: ValueError: output"
    with pytest.raises(ValueError, match=refused), _agreed():
        pass


def test_the_mode_follows_the_environment_unless_the_session_says(monkeypatch) -> None:
    for raw, want in (("1", True), ("0", False), ("", False), (" 1 ", True)):
        monkeypatch.setenv(context.DEBUG_COLLECTIVES_ENV, raw)
        assert context.CommContext().debug_collectives is want
    monkeypatch.setenv(context.DEBUG_COLLECTIVES_ENV, "yes")
    with pytest.raises(
        ValueError, match="ZEROPP_DEBUG_COLLECTIVES='yes' is not a valid setting; set ZEROPP_DEBUG_COLLECTIVES=1"
    ):
        context.CommContext()
    monkeypatch.delenv(context.DEBUG_COLLECTIVES_ENV)
    ctx = context.CommContext()
    monkeypatch.setattr(context, "current", lambda: ctx)
    s = CommSession()
    assert s.check_collectives is False
    ctx.debug_collectives = True
    assert s.check_collectives is True  # unset: the process's setting
    s.check_collectives = False
    assert s.check_collectives is False and CommSession(check_collectives=True).check_collectives is True
    s.check_collectives = None
    assert s.check_collectives is True
