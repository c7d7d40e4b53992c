"""hpZ with qwZ keeps its secondary copy as the gathered wire rows (``UnitGathers.keeps_rows``).

The reference is the same engine keeping full-precision secondaries (``keeps_rows`` patched to
False, the behaviour before): every loss, gradient norm and final weight must be identical bit
for bit, because both dequantize the very same rows, while the backward gathers inside the node
carry the rows' bytes instead of fp32 values, exactly as the plan says.
"""

from typing import Any

from tests.runtime_helpers import train_engine
from tests.worlds import run_world
from zeropp.comm.spec import QuantSpec

# two micro-steps: each step's second forward gathers from the secondary too
ZPP = dict(stage=3, weights=QuantSpec(bits=8), hpz=True, grads=QuantSpec(bits=4), grad_accum_steps=2)


def _world(rank: int, world: int) -> dict[str, Any]:
    from zeropp.runtime.gathers import UnitGathers

    out = {"rows": train_engine(rank, world, ZPP, steps=3, nodes=2)}
    UnitGathers.keeps_rows = lambda self, u: False  # type: ignore[method-assign]  # the full-precision reference
    out["fp32"] = train_engine(rank, world, ZPP, steps=3, nodes=2)
    return out


def _bwd_intra(r: dict[str, Any]) -> int:
    return r["comm"]["bwd_all_gather"]["intra"]


def test_quantized_secondary_is_bit_exact_and_sends_the_wire_rows() -> None:
    from tests.runtime_helpers import make_model
    from zeropp.comm import Topology
    from zeropp.runtime import ZeroConfig
    from zeropp.runtime.plan import build_plan, plan_units
    from zeropp.runtime.plan_kinds import CommKind, Group

    res = run_world(_world, 4)
    for r in res:
        rows, ref = r["rows"], r["fp32"]
        assert rows["losses"] == ref["losses"] and rows["norms"] == ref["norms"]
        assert rows["weights"].keys() == ref["weights"].keys()
        for k, v in ref["weights"].items():
            assert (rows["weights"][k] == v).all(), k
        # fp32 secondaries send 4 bytes an element inside the node; the INT8 rows a bit over 1
        assert 0.24 * _bwd_intra(ref) < _bwd_intra(rows) < 0.3 * _bwd_intra(ref), (_bwd_intra(rows), _bwd_intra(ref))
        assert rows["memory"]["hpz_secondary"] < 0.3 * ref["memory"]["hpz_secondary"]
    plan = build_plan(plan_units(make_model()), ZeroConfig(**ZPP), Topology(nodes=2, ranks_per_node=2))
    hpz = [c for c in plan.collectives if c.kind == CommKind.BWD_ALL_GATHER and c.group == Group.HPZ]
    assert hpz and all(c.spec == ZPP["weights"] for c in hpz)
