"""The collectives debug mode (``ZEROPP_DEBUG_COLLECTIVES=1``, ``zeropp.comm.callcheck``) on a
2x2 gloo world launched with it set.

Each rank makes a call that differs from its peers' in one respect (element count, bits, spec or
none, dtype, op, topology, a local argument error on one rank only), for the all-gather, the
reduce-scatter (one hop and qgZ's two hops), the all-reduces, and on a sub-group. Every rank must
raise, the same ValueError on every rank of the group for a mismatch, naming each rank's value
and what to change, and nobody may hang (the launch has a timeout, and a good call after all of
them still works). Matching calls give bit for bit the results with the check on and off, async
and stochastic rounding included (the check takes no stochastic call index).

Without the mode the backend pairs many of these calls without complaint and the result is
silently wrong (quantized rows are padded to whole groups, so 1000 and 1024 elements give rows of
one size); that is why the mode exists, and why these tests fail without it.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.distributed as dist

from tests.worlds import run_world
from zeropp.comm import (
    CommSession,
    QuantSpec,
    ReduceOp,
    Topology,
    all_reduce,
    default_session,
    quantized_all_gather,
    quantized_all_reduce,
    quantized_reduce_scatter,
)
from zeropp.comm.context import DEBUG_COLLECTIVES_ENV

ENV = {DEBUG_COLLECTIVES_ENV: "1"}
Q8, Q4 = QuantSpec(bits=8), QuantSpec(bits=4)


def _mismatches(rank: int, topo: Topology) -> dict[str, Callable[[], object]]:
    """Calls whose arguments differ between the ranks (rank 0 or the odd ranks stand out)."""
    W = topo.world_size
    odd = rank % 2 == 1
    n = 1024 if rank == 1 else 1000  # rows of one size at 8 bits (two groups of 512)
    x = torch.full((n,), float(rank + 1))

    def ag(count: int, spec, dtype=torch.float32, out_numel=None, group=None) -> None:
        w = W if group is None else dist.get_world_size(group)
        out = torch.empty(w * count if out_numel is None else out_numel, dtype=dtype)
        quantized_all_gather(out, torch.ones(count, dtype=dtype), group, spec=spec, topology=topo)

    def rs(count: int, spec, op=ReduceOp.AVG, topology=topo, dtype=torch.float32) -> None:
        out = torch.empty(count, dtype=dtype)
        quantized_reduce_scatter(out, torch.ones(W * count, dtype=dtype), op, spec=spec, topology=topology)

    intra = topo.build().intra
    return {
        "all-gather element count": lambda: quantized_all_gather(torch.empty(W * n), x, spec=Q8, topology=topo),
        "all-gather bits": lambda: ag(512, Q4 if odd else Q8),
        "all-gather plain element count": lambda: ag(n, None),
        "all-gather plain dtype": lambda: ag(8, None, torch.float64 if odd else torch.float32),
        "all-gather spec or none": lambda: ag(8, Q8 if odd else None),
        "all-gather scheme": lambda: ag(64, QuantSpec(bits=8, scheme="fp8") if odd else Q8),
        "all-gather output wrong on rank 0 only": lambda: ag(8, Q8, out_numel=W * 8 + (rank == 0)),
        "all-gather on the intra-node group": lambda: ag(8 + (rank % 2), Q8, group=intra),
        "reduce-scatter element count": lambda: rs(n, Q8),
        "reduce-scatter bits (qgZ)": lambda: rs(64, Q4 if odd else Q8),
        "reduce-scatter intra bits (qgZ)": lambda: rs(64, QuantSpec(bits=4, intra_bits=8) if odd else Q4),
        "reduce-scatter plain element count": lambda: rs(n, None),
        "reduce-scatter op": lambda: rs(8, Q8, ReduceOp.SUM if odd else ReduceOp.AVG),
        "reduce-scatter topology": lambda: rs(8, Q8, topology=Topology(1, W) if odd else topo),
        "reduce-scatter MAX on rank 0 only": lambda: rs(8, Q8, ReduceOp.MAX if rank == 0 else ReduceOp.SUM),
        "all-reduce element count": lambda: all_reduce(torch.ones(n), topology=topo),
        "quantized all-reduce spec": lambda: quantized_all_reduce(torch.ones(40), spec=Q4 if odd else Q8),
    }


def _world(rank: int, world: int) -> dict:
    topo = Topology(2, 2)
    res: dict = {"on": default_session().check_collectives, "errors": {}}
    for name, fn in _mismatches(rank, topo).items():
        try:
            fn()
            res["errors"][name] = None
        except (ValueError, TypeError) as e:
            res["errors"][name] = f"{type(e).__name__}: {e}"
    # nobody is stuck half-way through a collective: a good call still works on every rank
    good = torch.empty(world * 3)
    quantized_all_gather(good, torch.full((3,), float(rank)), topology=topo)
    assert good.tolist() == [float(r) for r in range(world) for _ in range(3)]
    res["same_on_and_off"] = _same_on_and_off(rank, world, topo)
    return res


def _run(session: CommSession, rank: int, world: int, topo: Topology) -> list[torch.Tensor]:
    """Every public collective on this rank's fixed inputs, through ``session``."""
    g = torch.Generator().manual_seed(10 + rank)
    outs: list[torch.Tensor] = []
    for spec in (
        None,
        Q8,
        Q4,
        QuantSpec(bits=4, intra_bits=8, group_size=64),
        QuantSpec(bits=8, rounding="stochastic", seed=3),
        QuantSpec(bits=8, scheme="fp8"),
    ):
        x = torch.randn(world * 300, generator=g)
        gathered = torch.empty(world * 300)
        gspec = None if spec is None else QuantSpec(bits=spec.bits, rounding=spec.rounding, seed=3, scheme=spec.scheme)
        quantized_all_gather(gathered, x[:300], spec=gspec, topology=topo, session=session)
        chunk = torch.empty(300)
        h = quantized_reduce_scatter(chunk, x, spec=spec, topology=topo, session=session, async_op=True)
        assert h is not None
        h.wait()
        outs += [gathered, chunk]
    t = torch.randn(77, generator=g)
    outs.append(quantized_all_reduce(t.clone(), spec=Q4, gather_spec=Q8, topology=topo, session=session))
    all_reduce(t, topology=topo, session=session)
    return [*outs, t]


def _same_on_and_off(rank: int, world: int, topo: Topology) -> bool:
    on = _run(CommSession(topo, check_collectives=True), rank, world, topo)
    off = _run(CommSession(topo, check_collectives=False), rank, world, topo)
    return all(torch.equal(a, b) for a, b in zip(on, off, strict=True))


@pytest.fixture(scope="module")
def world() -> list[dict]:
    """One 2x2 launch with the mode on, shared by the tests below (a launch costs seconds)."""
    return run_world(_world, 4, timeout=120, env=ENV)


def test_mismatched_calls_raise_the_same_error_on_every_rank(world) -> None:
    res = world
    assert all(r["on"] for r in res), "the launcher's environment did not switch the mode on"
    for case in res[0]["errors"]:
        per_rank = [r["errors"][case] for r in res]
        assert all(m is not None for m in per_rank), f"{case}: some rank did not raise: {per_rank}"
        if "only" not in case and "intra-node" not in case:
            assert len(set(per_rank)) == 1, f"{case}: ranks raised different errors: {per_rank}"
            assert per_rank[0].startswith("ValueError: ") and "ZEROPP_DEBUG_COLLECTIVES" in per_rank[0], per_rank
    msgs = res[0]["errors"]
    assert "n: rank 0: 1000, rank 1: 1024, rank 2: 1000, rank 3: 1000" in msgs["all-gather element count"]
    assert "pad every rank's tensor to the largest, 1024 elements" in msgs["all-gather element count"]
    assert "spec.bits: rank 0: 8, rank 1: 4, rank 2: 8, rank 3: 4" in msgs["all-gather bits"]
    assert "pass one QuantSpec on every rank" in msgs["all-gather bits"]
    assert "dtype: rank 0: 'float32', rank 1: 'float64'" in msgs["all-gather plain dtype"]
    assert "spec: rank 0: None (plain), rank 1: QuantSpec(bits=8" in msgs["all-gather spec or none"]
    assert "spec.scheme: rank 0: 'int', rank 1: 'fp8'" in msgs["all-gather scheme"]
    assert "spec.bits: rank 0: 8, rank 1: 4" in msgs["reduce-scatter bits (qgZ)"]
    assert "spec.intra_bits: rank 0: None, rank 1: 8" in msgs["reduce-scatter intra bits (qgZ)"]
    assert "op: rank 0: 'avg', rank 1: 'sum'" in msgs["reduce-scatter op"]
    assert "topology: rank 0: '2x2', rank 1: '1x4'" in msgs["reduce-scatter topology"]
    assert "quantized_all_reduce:" in msgs["quantized all-reduce spec"]
    assert "all_reduce: " in msgs["all-reduce element count"]
    # a local error on one rank: that rank raises its own, the others name it instead of waiting
    own, peers = (
        msgs["all-gather output wrong on rank 0 only"],
        [r["errors"]["all-gather output wrong on rank 0 only"] for r in res[1:]],
    )
    assert "allocate output with 32 elements" in own and "refused" not in own
    assert all("other ranks of the group refused this call (rank 0: ValueError: all-gather output" in m for m in peers)
    assert "use spec=None" in msgs["reduce-scatter MAX on rank 0 only"]
    # a sub-group: each node's pair agrees within itself and names its own global ranks
    sub = [r["errors"]["all-gather on the intra-node group"] for r in res]
    assert sub[0] == sub[1] and sub[2] == sub[3] and "group ([2, 3])" in sub[2] and "rank 3: 9" in sub[2], sub


def test_matching_calls_give_the_same_bits_with_the_check_on_and_off(world) -> None:
    assert all(r["same_on_and_off"] for r in world)
