"""ZeRO++ switches, memory accounting and byte accounting, in one 2-node x 2-rank world.

Tolerance for the switches (stated here, checked below): over 8 steps of training on English
text at lr 1e-2, where the loss falls by more than 0.5, every step's loss stays within
``TOL_8BIT`` (8-bit qwZ, 8-bit qgZ) or ``TOL_4BIT`` (anything with 4-bit) of the unquantized
run's loss at the same step, relative. hpZ without quantization changes only the route of the
backward gather, so it must be bit-exact.
"""

import pytest

from tests.quant_bands import CFG, LR, STEPS, TOL_4BIT, TOL_8BIT
from tests.runtime_helpers import make_model, train_engine
from tests.worlds import run_world
from zeropp.comm import Topology
from zeropp.comm.spec import QuantSpec
from zeropp.runtime import ZeroConfig, expected_memory, hpz_bytes_per_param
from zeropp.runtime.plan import build_plan, plan_units
from zeropp.runtime.plan_kinds import Group, Phase

W8, W4, G8, G4 = QuantSpec(bits=8), QuantSpec(bits=4), QuantSpec(bits=8), QuantSpec(bits=4)
S3 = dict(stage=3)
SWITCHES = {
    "base": S3,
    "qwz8": dict(S3, weights=W8),
    "qwz4": dict(S3, weights=W4),
    "hpz": dict(S3, hpz=True),
    "hpz1": dict(S3, hpz=True, hpz_size=1),  # secondary = the whole block on each rank: no backward traffic
    "qgz4": dict(S3, grads=G4),
    "qgz4_ef": dict(S3, grads=G4.replace(error_feedback=True)),
    "qgz_8_4": dict(S3, grads=G4.replace(intra_bits=8)),
    "all": dict(S3, weights=W8, hpz=True, grads=G4, grad_accum_steps=2),
    "stochastic": dict(
        S3, weights=W8.replace(rounding="stochastic"), grads=G4.replace(rounding="stochastic")
    ),  # unbiased
    "s2_qgz4": dict(stage=2, grads=G4),
    "s1_qgz8": dict(stage=1, grads=G8),
    "bf16_z3": dict(S3, precision="bf16"),
    "bf16_zpp": dict(S3, precision="bf16", weights=W8, hpz=True, grads=G4),
    "fp16_z3": dict(S3, precision="fp16", loss_scale_init=2.0**18, loss_scale_window=3),
}
TOLS = {"qwz8": TOL_8BIT, "s1_qgz8": TOL_8BIT, "bf16_z3": TOL_8BIT, "fp16_z3": TOL_8BIT}
MEMORY = {f"mem{s}": dict(stage=s, precision="bf16") for s in (0, 1, 2)}
# The measurements below are for the GPT with its own head weight (CFG). Tied (the GPT's default), INT4
# qwZ quantizes the embedding and the head with one and the same error, and the first gradient norm
# moves 26% instead of 8% (8-bit: 0.2% either way); test_runtime_tied covers tied weights.


def _world(rank, world):
    out = {}
    for name, kw in SWITCHES.items():  # each engine counts its own stochastic calls (its session's counter)
        out[name] = train_engine(rank, world, kw, steps=STEPS, nodes=2, lr=LR, text=True, consolidate=False, cfg=CFG)
    out.update(
        {
            name: train_engine(rank, world, kw, steps=1, nodes=2, lr=LR, text=True, consolidate=False, cfg=CFG)
            for name, kw in MEMORY.items()
        }
    )
    return out


@pytest.fixture(scope="module")
def runs():
    return run_world(_world, 4, timeout=300)[0]


def test_each_switch_and_all_together_track_the_unquantized_loss(runs):
    base = runs["base"]["losses"]
    assert base[0] - min(base) > 0.5, f"training must make progress for the comparison to mean something: {base}"
    assert runs["hpz"]["losses"] == base  # exact: same weights, different route
    assert runs["hpz1"]["losses"] == base
    for name in SWITCHES:
        if name in ("base", "fp16_z3"):
            continue
        tol = TOLS.get(name, TOL_4BIT)
        for step, (a, b) in enumerate(zip(runs[name]["losses"], base)):
            assert abs(a - b) <= tol * b, (name, step, runs[name]["losses"], base)


def test_stochastic_rounding_reaches_every_quantized_collective(runs):
    """weights / grads with rounding="stochastic": every quantized gather and reduce-scatter of the engine
    takes a stochastic call index (the seed rule's counter); the other switches take none."""
    r = runs["stochastic"]
    quantized = sum(r["calls"].get(k, 0) for k in ("fwd_all_gather", "bwd_all_gather", "grad_reduce_scatter"))
    assert r["stochastic_calls"] == quantized > 0, (r["stochastic_calls"], r["calls"])
    assert all(runs[name]["stochastic_calls"] == 0 for name in SWITCHES if name != "stochastic")


def test_each_switch_keeps_the_gradient_scale(runs):
    """Adam normalises each element's step, so a gradient off by a constant factor (DeepSpeed's qgZ
    averaging over nodes instead of the world: x2 here) leaves the losses above almost unchanged.
    The first step's global gradient norm (same weights in every run) catches it: quantization
    error is near-orthogonal to the gradient and moves the norm little. Measured: 0.1-0.7% for
    qgZ and bf16, 8% for INT4 qwZ, -9% for "all" (whose 2 micro-batches also change the data);
    the bug gave +100%."""
    base = runs["base"]["norms"][0]
    for name in SWITCHES:
        if name == "fp16_z3":  # its first steps overflow on purpose
            continue
        got = runs[name]["norms"][0]
        assert abs(got - base) <= 0.25 * base, (name, got, base)


def test_fp16_loss_scaling_skips_overflows_then_trains(runs):
    r = runs["fp16_z3"]
    assert r["skipped"][0], "2**18 must overflow fp16 gradients"
    skipped = sum(r["skipped"])
    assert not r["skipped"][-1]
    # the scale halves on every overflow, doubles after `window` good steps
    for a, b, sk in zip(r["scales"], r["scales"][1:], r["skipped"]):
        assert b == a / 2 if sk else b in (a, 2 * a)
    # after the overflows the scale settles and training proceeds like the fp32 run does
    assert r["losses"][-1] < r["losses"][skipped] - 0.5, r["losses"]
    assert all(x == x and x < float("inf") for x in r["norms"][skipped:])


def test_memory_report_matches_the_zero_table(runs):
    cases = {"mem0": (0, None), "mem1": (1, None), "mem2": (2, None), "bf16_z3": (3, None), "bf16_zpp": (3, 2)}
    for name, (stage, hpz) in cases.items():
        got = runs[name]["memory"]
        # with qwZ, hpZ's secondary is kept as the INT8 wire rows: about 1 byte per parameter, not 2
        hpz_bytes = hpz_bytes_per_param(SWITCHES.get(name, {}).get("weights"), 2)
        want = expected_memory(stage, runs[name]["num_params"], 4, param_bytes=2, hpz_size=hpz, hpz_bytes=hpz_bytes)
        for key, w in want.items():
            if key in ("hpz_secondary", "total") and hpz:  # the tiny units' rows pad to whole groups: exact below
                continue
            assert abs(got[key] - w) <= 0.05 * w, (name, key, got, want)
    # exactly the wire rows the plan's backward hpZ gathers send to each peer (this rank's share of every unit)
    plan = build_plan(
        plan_units(make_model(CFG)), ZeroConfig(**SWITCHES["bf16_zpp"]), Topology(nodes=2, ranks_per_node=2)
    )
    rows = [c for c in plan.collectives if c.phase == Phase.BWD and c.group == Group.HPZ]
    assert rows and all(c.spec == W8 for c in rows)
    assert runs["bf16_zpp"]["memory"]["hpz_secondary"] == sum(c.peer_bytes for c in rows)
    assert runs["bf16_zpp"]["memory"]["hpz_secondary"] < 0.6 * runs["bf16_z3"]["memory"]["params"] * 2  # bf16: 2 shards
    # fp32 compute: 4-byte parameters and gradients; the fp32 master IS the parameter shard (no
    # second copy), so the optimizer holds only m and v: 8 bytes instead of 12
    for name, hpz in (("base", None), ("hpz1", 1)):
        got = runs[name]["memory"]
        want = expected_memory(3, runs[name]["num_params"], 4, param_bytes=4, hpz_size=hpz)
        psi = runs[name]["num_params"]
        want["optimizer"] -= 4 * psi / 4
        want["total"] -= 4 * psi / 4
        assert all(abs(got[k] - w) <= 0.05 * w for k, w in want.items()), (name, got, want)


def _cross(r, kind=None):
    return sum(v["cross"] for k, v in r["comm"].items() if kind is None or k == kind)


def test_byte_accounting_hpz_and_the_zeropp_cross_node_cut(runs):
    # hpZ: backward gathers stay inside the node
    for name in ("hpz", "all", "bf16_zpp"):
        assert _cross(runs[name], "bwd_all_gather") == 0 and runs[name]["comm"]["bwd_all_gather"]["intra"] > 0
    assert _cross(runs["base"], "bwd_all_gather") > 0
    assert "bwd_all_gather" not in runs["hpz1"]["comm"] or not any(runs["hpz1"]["comm"]["bwd_all_gather"].values())
    # ZeRO-3 sends 3M per step; half of each collective's peers are on the other node
    z3 = runs["bf16_z3"]
    psi, world, rpn = z3["num_params"], 4, 2
    per_collective = 2 * psi / world * (world - rpn)  # bf16 bytes of my shard to each cross-node peer
    assert abs(_cross(z3) / STEPS - 3 * per_collective) <= 0.05 * 3 * per_collective
    # ZeRO++ (qwZ 8 + hpZ + qgZ 4) cuts that by at least 4x
    ratio = _cross(runs["bf16_zpp"]) / _cross(z3)
    assert ratio <= 0.25, ratio
