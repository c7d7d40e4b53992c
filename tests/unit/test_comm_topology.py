"""Cheap, single-process checks: Topology arithmetic, CommStats, the qgZ swizzle, ErrorFeedback."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from zeropp.comm import CommStats, ErrorFeedback, QuantSpec, Topology
from zeropp.comm.qgz import swizzle, unswizzle


@pytest.mark.parametrize(
    "nodes,rpn,hpz", [(1, 4, None), (2, 2, None), (3, 2, None), (2, 4, 2), (4, 2, 1), (3, 1, None)]
)
def test_groups_partition_the_world(nodes: int, rpn: int, hpz) -> None:
    t = Topology(nodes, rpn, hpz)
    W = t.world_size
    assert nodes * rpn == W and t.hpz_group_size == (rpn if hpz is None else hpz)
    for family in (t.intra_ranks, t.cross_ranks, t.hpz_ranks):
        groups = {tuple(family(r)) for r in range(W)}
        # every rank is in exactly one group of the family, and in its own
        assert sorted(itertools.chain(*groups)) == list(range(W))
        assert all(r in family(r) for r in range(W))
    for r in range(W):
        assert r == t.node_of(r) * rpn + t.local_rank(r)
        assert set(t.intra_ranks(r)) & set(t.cross_ranks(r)) == {r}
        assert all(t.same_node(r, p) for p in t.intra_ranks(r))
        assert all(t.same_node(r, p) for p in t.hpz_ranks(r))  # hpZ never crosses a node
        assert [t.node_of(p) for p in t.cross_ranks(r)] == list(range(nodes))


def test_from_world_and_validation_errors() -> None:
    assert Topology.from_world(6, 2) == Topology(3, 2)
    assert Topology.from_world(4, 4) == Topology(1, 4)
    with pytest.raises(ValueError, match=r"not a multiple of ranks_per_node=4.*\[1, 2, 3, 6\]"):
        Topology.from_world(6, 4)
    with pytest.raises(ValueError, match="nodes must be a positive int"):
        Topology(0, 2)
    with pytest.raises(ValueError, match="ranks_per_node must be a positive int"):
        Topology(2, 2.0)
    with pytest.raises(ValueError, match="hpz_size=3 must be a positive divisor of ranks_per_node=4"):
        Topology(2, 4, hpz_size=3)
    with pytest.raises(ValueError, match="outside this topology"):
        Topology(2, 2).node_of(4)
    with pytest.raises(ValueError, match=r"describes 8 ranks but the process group has 4"):
        Topology(2, 4).check_world(4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        Topology(2, 2).nodes = 3  # type: ignore[misc]


def test_comm_stats_record_snapshot_total_reset() -> None:
    s = CommStats()
    s.record("all_gather", "intra", 10)
    s.record("all_gather", "cross", 5)
    s.record("reduce_scatter", "cross", 7)
    s.count_call("all_gather")
    assert s.snapshot() == {"all_gather": {"intra": 10, "cross": 5}, "reduce_scatter": {"intra": 0, "cross": 7}}
    assert (s.total(), s.total(link="cross"), s.total(kind="all_gather"), s.total("cross", "reduce_scatter")) == (
        22,
        12,
        15,
        7,
    )
    other = CommStats()
    other.merge(s)
    other.merge(s)
    assert other.total() == 44 and other.calls() == {"all_gather": 2}
    s.reset()
    assert s.snapshot() == {} and s.total() == 0
    with pytest.raises(ValueError, match="link must be one of"):
        s.record("x", "nvlink", 1)


@pytest.mark.parametrize("nodes,rpn", [(2, 2), (3, 2), (2, 4), (1, 4)])
def test_swizzle_sends_each_local_peer_the_chunks_it_owns(nodes: int, rpn: int) -> None:
    W, n = nodes * rpn, 3
    x = torch.arange(W, dtype=torch.float32).repeat_interleave(n).view(W, n)  # row j holds value j
    xs = swizzle(x, nodes, rpn)
    for lc in range(rpn):
        piece = xs[lc * nodes : (lc + 1) * nodes, 0].long().tolist()
        assert piece == [m * rpn + lc for m in range(nodes)]  # chunk of node m's rank with local lc
    assert torch.equal(unswizzle(xs, nodes, rpn), x)


def test_error_feedback_buckets() -> None:
    ef = ErrorFeedback(residual_bits=32)  # fp32 storage: exact values, 4 bytes each
    assert torch.equal(ef.residual("a", 4, torch.device("cpu")), torch.zeros(4))
    ef.store("a", torch.tensor([1.0, float("nan"), float("inf"), -2.0]))
    assert ef.residual("a", 4, torch.device("cpu")).tolist() == [1.0, 0.0, 0.0, -2.0]  # non-finite -> 0
    assert ef.keys() == ["a"] and ef.nbytes() == 16
    with pytest.raises(ValueError, match="bucket 'a' holds 4 elements but this call has 5"):
        ef.residual("a", 5, torch.device("cpu"))
    ef.reset("a")
    assert ef.keys() == []


def test_plugins_refuse_a_plain_value_on_one_side_of_bits_and_intra_bits() -> None:
    """Checked when the spec (and so the plug-in) is built, not in the first backward (no process
    group needed)."""
    from zeropp.comm.ddp import QuantizedAllReduceState
    from zeropp.comm.fsdp import QuantizedReduceScatter

    def spec(b, ib):  # the old (bits, intra_bits) pair as a spec; both plain = spec None
        return None if b is None and ib is None else QuantSpec(bits=b, intra_bits=ib)

    for make in (
        lambda b, ib: QuantizedAllReduceState(grads=spec(b, ib)),
        lambda b, ib: QuantizedReduceScatter(spec(b, ib)),
    ):
        with pytest.raises(ValueError, match="unquantized intra-node hop"):
            make(4, 16)
        with pytest.raises(ValueError, match="bits=None means no quantization; pass spec=None"):
            make(None, 8)
        make(4, 8), make(None, None), make(8, None)  # all fine (both plain: spec None)


def test_plugins_check_spec_and_error_feedback_when_built() -> None:
    """Per-hop settings on a one-hop gather, specs of the wrong type and recipe misuse are refused
    when the plug-in is built; error-feedback state is created by the plug-in that owns it."""
    from torch import nn

    from zeropp.comm.ddp import QuantizedAllReduceState
    from zeropp.comm.fsdp import QuantizedAllGather, QuantizedReduceScatter, apply_zeropp_comms

    with pytest.raises(ValueError, match="intra_bits=8 does nothing for an all-gather"):
        QuantizedAllGather(QuantSpec(bits=4, intra_bits=8))
    with pytest.raises(ValueError, match="error_feedback=True does nothing for an all-gather"):
        QuantizedAllReduceState(grads=QuantSpec(bits=4), gather=QuantSpec(bits=8, error_feedback=True))
    with pytest.raises(TypeError, match="must be a zeropp.comm.QuantSpec"):
        QuantizedReduceScatter(4)
    rs = QuantizedReduceScatter(QuantSpec(bits=4, error_feedback=True))
    assert isinstance(rs.error_feedback, ErrorFeedback)
    assert QuantizedReduceScatter(QuantSpec(bits=4)).error_feedback is None
    st = QuantizedAllReduceState(grads=QuantSpec(bits=4, error_feedback=True))
    assert isinstance(st.feedback, ErrorFeedback) and QuantizedAllReduceState(grads=None).feedback is None
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="either recipe="):
        apply_zeropp_comms(model, recipe="w8g4", weights=QuantSpec(bits=8))
    with pytest.raises(ValueError, match=r"reshard_after_forward=<ranks per node>"):
        apply_zeropp_comms(model, recipe="zeropp")
    with pytest.raises(ValueError, match="unknown quantization recipe 'int3'"):
        apply_zeropp_comms(model, recipe="int3")
    with pytest.raises(ValueError, match="no FSDP module"):
        apply_zeropp_comms(model, recipe="w8g4")
