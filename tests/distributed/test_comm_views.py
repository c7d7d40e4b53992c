"""The public collectives on tensors a user passes as they are: views (a slice with a stride, a
column block of a matrix, a transpose) and tensors that require grad (parameters).

A view: exactly its elements are reduced, the rest of the buffer it lives in is untouched,
synchronous or asynchronous (gloo reduces a tensor's storage from its offset, so a view handed to
it as is would reduce the wrong elements). A tensor that requires grad is reduced or gathered in
place as ``torch.distributed`` does it, quantized too, also when qgZ's second hop writes it on the
comm worker and when the wait runs with grad mode on."""

from __future__ import annotations

import torch
from torch import nn

from tests.worlds import run_world
from zeropp.comm import (
    QuantSpec,
    ReduceOp,
    Topology,
    all_reduce,
    quantized_all_gather,
    quantized_all_reduce,
    quantized_reduce_scatter,
)


def _base(rank: int) -> torch.Tensor:
    """A [4, 6] buffer, different on each rank: rank r's element i is (r + 1) * (i + 1)."""
    return (torch.arange(24, dtype=torch.float32) + 1).mul_(rank + 1).view(4, 6)


def _views(rank: int, world: int) -> dict[str, bool]:
    total = sum(r + 1 for r in range(world))  # the sum of every rank's base, element by element: total * (i + 1)
    out: dict[str, bool] = {}
    picks = {
        "every other element": lambda b: b.view(-1)[::2],
        "a column block": lambda b: b[:, 1:4],
        "a transpose": lambda b: b.t(),
        "one column": lambda b: b[:, 5],
    }
    for name, pick in picks.items():
        for async_op in (False, True):
            base = _base(rank)
            inside = torch.zeros(4, 6, dtype=torch.bool)
            pick(inside).fill_(True)
            h = all_reduce(pick(base), ReduceOp.SUM, async_op=async_op)
            if h is not None:
                h.wait()
            want = torch.where(inside, _base(0) * total, _base(rank))
            out[f"{name}, async={async_op}"] = torch.equal(base, want)
    return out


def test_all_reduce_of_a_view_reduces_the_view_and_nothing_else() -> None:
    for res in run_world(_views, 2):
        assert all(res.values()), {k: v for k, v in res.items() if not v}


def _param(rank: int, n: int) -> nn.Parameter:
    """Rank ``rank``'s parameter of ``n`` elements (each rank's values differ)."""
    return nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(rank)))


def _parameters(rank: int, world: int) -> dict[str, bool]:
    topo = Topology.from_world(world, ranks_per_node=2)  # 2 x 2: qgZ's second hop is a continuation
    topo.build()
    n, q8, q4 = 12, QuantSpec(bits=8), QuantSpec(bits=4, intra_bits=8)
    every = [_param(r, world * n).detach() for r in range(world)]
    mean = torch.stack(every).mean(0)  # [W * n]
    out: dict[str, bool] = {}

    for spec, tol in ((None, 1e-6), (q8, 0.05)):
        p = _param(rank, world * n)
        assert quantized_all_reduce(p, spec=spec, topology=topo) is p
        out[f"quantized_all_reduce, spec={spec}"] = p.requires_grad and torch.allclose(p.detach(), mean, atol=tol)

    p = _param(rank, world * n)
    all_reduce(p, ReduceOp.AVG, topology=topo)
    out["all_reduce"] = torch.allclose(p.detach(), mean, atol=1e-6)

    for spec, tol in ((None, 1e-6), (q4, 0.5)):
        mine = nn.Parameter(torch.zeros(n))
        with torch.enable_grad():
            h = quantized_reduce_scatter(mine, _param(rank, world * n), spec=spec, topology=topo, async_op=True)
            assert h is not None
            h.wait()
        out[f"reduce-scatter into a parameter, spec={spec}"] = torch.allclose(
            mine.detach(), mean.view(world, n)[rank], atol=tol
        )

    for spec, tol in ((None, 0.0), (q8, 0.05)):
        full = nn.Parameter(torch.zeros(world * n))
        with torch.enable_grad():
            h = quantized_all_gather(full, _param(rank, n), spec=spec, topology=topo, async_op=True)
            assert h is not None
            h.wait()
        want = torch.cat([_param(r, n).detach() for r in range(world)])
        out[f"all-gather into a parameter, spec={spec}"] = torch.allclose(full.detach(), want, atol=tol)
    return out


def test_tensors_that_require_grad_are_reduced_and_gathered_in_place() -> None:
    for res in run_world(_parameters, 4):
        assert all(res.values()), {k: v for k, v in res.items() if not v}


def _overlapping_rows(rank: int, world: int) -> dict[str, object]:
    n = 8
    x = torch.full((n,), float(rank + 1))
    out: dict[str, object] = {}
    for name, make in {
        "expanded": lambda: torch.zeros(n).expand(world, n),
        "overlapping": lambda: torch.zeros(world * n).as_strided((world, n), (n // 2, 1)),
    }.items():
        try:
            quantized_all_gather(make(), x, spec=QuantSpec(bits=8))
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    rows = torch.zeros(world, 2 * n)[:, :n]  # a [W, n] column block of a wider buffer: gathered in place
    quantized_all_gather(rows, x, spec=QuantSpec(bits=8))
    out["column block"] = rows.tolist()
    return out


def test_an_all_gather_output_with_overlapping_rows_is_refused_before_sending() -> None:
    for r in run_world(_overlapping_rows, 2):
        for name in ("expanded", "overlapping"):
            msg = r[name]
            assert isinstance(msg, str) and msg.startswith("all-gather output must be contiguous or, quantized,"), msg
        assert r["column block"] == [[1.0] * 8, [2.0] * 8], r
