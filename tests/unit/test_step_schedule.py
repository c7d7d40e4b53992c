"""The scheduled step-time model (experiments/projection/step_schedule.py): hand-computed timelines, the serial
formula where nothing can overlap, bounds on every stage and recipe, and the CPU-side calibration
``bench_cluster --check`` uses."""

from __future__ import annotations

import dataclasses

import pytest

from zeropp.comm.spec import RECIPES
from zeropp.experiments.projection.scaling import (
    collective_time,
    control_time,
    gpt_units,
    messages,
    project,
    quant_time,
)
from zeropp.experiments.projection.scaling_check import calibrate_cpu_side, emulator_cluster
from zeropp.experiments.projection.spec import Cluster, Workload
from zeropp.experiments.projection.step_schedule import (
    Transfer,
    UnitCosts,
    message_transfer,
    project_scheduled,
    scheduled_step_s,
    unit_costs,
)

UNITS = gpt_units(vocab=256, seq_len=16, d_model=32, n_layers=3)
RATES = (
    ("quantize", 8, 2.0),
    ("quantize", 4, 2.0),
    ("dequantize", 8, 4.0),
    ("dequantize", 4, 4.0),
    ("dequantize_sum", 4, 3.0),
    ("dequantize_sum_requantize", 4, 2.5),
)


def _hand_units() -> list[UnitCosts]:
    """Root + 2 blocks, link-only transfers, round numbers (see the expected timelines below)."""
    root = UnitCosts(fwd_s=0.0, bwd_s=0.0, fwd=Transfer(link_s=1), bwd=Transfer(link_s=1), reduce=Transfer(link_s=1))
    block = UnitCosts(fwd_s=1.0, bwd_s=2.0, fwd=Transfer(link_s=2), bwd=Transfer(link_s=2), reduce=Transfer(link_s=3))
    return [root, block, block]


def test_stage3_timeline_by_hand() -> None:
    # prefetch 1: fwd root [0,1]; G0 [1,3]; wait 3, G1 [3,5], F0 -> 4; wait 5, F1 -> 6.
    # bwd root [6,7]; G_b1 [7,9]; wait 9, G_b0 [9,11], B1 -> 11, RS1 [11,14]; B0 -> 13, RS0 [14,17];
    # root RS [17,18] -> 18.
    assert scheduled_step_s(_hand_units(), stage=3, prefetch=1) == pytest.approx(18.0)
    # prefetch 0: every gather waits where it is needed, and G_b0 queues behind RS1 on the link:
    # fwd 1 + (2 + 1) + (2 + 1) = 7; bwd root -> 8, G_b1 -> 10, B1 -> 12, RS1 [12,15], G_b0 [15,17],
    # B0 -> 19, RS0 [19,22], root RS [22,23].
    assert scheduled_step_s(_hand_units(), stage=3, prefetch=0) == pytest.approx(23.0)


def test_stage2_overlaps_reduces_with_backward_and_stage1_does_not() -> None:
    # stage 2: fwd 2, B1 -> 4, RS1 [4,7], B0 -> 6, RS0 [7,10], root RS [10,11]
    assert scheduled_step_s(_hand_units(), stage=2) == pytest.approx(11.0)
    # stage 1: compute 6, then RS1, RS0, root: 6 + 3 + 3 + 1
    assert scheduled_step_s(_hand_units(), stage=1) == pytest.approx(13.0)
    # two micro-batches at stage 1: reduced once, after the second backward
    assert scheduled_step_s(_hand_units(), stage=1, micro_batches=2) == pytest.approx(19.0)


def test_quantization_precedes_its_transfer() -> None:
    u = [UnitCosts(fwd_s=0.0, bwd_s=1.0, reduce=Transfer(quant_s=0.5, link_s=2.0))]
    assert scheduled_step_s(u, stage=2) == pytest.approx(1.0 + 0.5 + 2.0)
    # a compute-side part (CPU ranks' copies) runs beside the transfer
    u = [UnitCosts(fwd_s=0.0, bwd_s=1.0, reduce=Transfer(quant_s=0.5, compute_s=1.5, link_s=2.0))]
    assert scheduled_step_s(u, stage=2) == pytest.approx(1.0 + 0.5 + 2.0)
    u = [UnitCosts(fwd_s=0.0, bwd_s=1.0, reduce=Transfer(quant_s=0.5, compute_s=3.0, link_s=2.0))]
    assert scheduled_step_s(u, stage=2) == pytest.approx(1.0 + 0.5 + 3.0)


@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.parametrize("bucket,accum", [(10**9, 1), (700, 3)])
def test_gpu_stages_0_1_equal_the_serial_formula(stage: int, bucket: int, accum: int) -> None:
    """Nothing overlaps at stages 0-1 (one reduction after backward, then the parameter gather):
    without quantization the schedule is exactly compute + every collective + control."""
    w = Workload(
        units=UNITS,
        compute_s=0.3,
        tokens_per_rank=64,
        stage=stage,
        reduce_bucket=bucket,
        allgather_bucket=bucket,
        grad_accum=accum,
    )
    c = Cluster(nodes=3, ranks_per_node=2, cross_gbps=1.0)
    assert project_scheduled(w, c).step_s == pytest.approx(project(w, c).step_s, rel=1e-12)


def _cases():
    for stage in (0, 1, 2, 3):
        for recipe in ("none", "zeropp", "qwd", "sdp4bit", "qgz"):
            r = RECIPES[recipe]
            if (stage < 3 and (r.hpz or r.weights)) or (stage == 0 and (r.grads or r.weight_diff)):
                continue
            if r.weight_diff and stage == 3 and not r.hpz:
                continue
            yield stage, recipe


@pytest.mark.parametrize("stage,recipe", list(_cases()))
@pytest.mark.parametrize("cpu", [False, True])
def test_bounds_every_stage_and_recipe(stage: int, recipe: str, cpu: bool) -> None:
    """No faster than the busier resource, no slower than doing everything in turn."""
    r = RECIPES[recipe]
    for accum, prefetch, compute in ((1, 1, 0.05), (2, 0, 0.5), (3, 2, 0.01)):
        w = Workload(
            units=UNITS,
            compute_s=compute,
            tokens_per_rank=64,
            stage=stage,
            weights=r.weights,
            grads=r.grads,
            hpz=r.hpz,
            weight_diff=r.weight_diff,
            grad_accum=accum,
            quant_rates=RATES,
            reduce_bucket=900,
        )
        c = (
            emulator_cluster(2, 2, 0.5, comm_on_compute=True)
            if cpu
            else Cluster(nodes=2, ranks_per_node=4, cross_gbps=10.0)
        )
        units = unit_costs(w, c)
        once = ("post", "reduce") if stage < 2 else ("post",)  # per step; the rest per micro-batch
        per_step = [
            (t, 1 if phase in once else accum)
            for u in units
            for phase, t in (("fwd", u.fwd), ("bwd", u.bwd), ("reduce", u.reduce), ("post", u.post))
        ]
        compute_side = compute + sum(k * (t.quant_s + t.compute_s) for t, k in per_step)
        link = sum(k * t.link_s for t, k in per_step)
        step = project_scheduled(w, c, prefetch=prefetch).step_s
        assert max(compute_side, link) - 1e-12 <= step <= compute_side + link + control_time(w, c) + 1e-12


@pytest.mark.parametrize("recipe", ["zeropp", "none", "qwd"])
def test_unit_costs_conserve_the_models_totals(recipe: str) -> None:
    """Splitting by unit and phase loses nothing: link time sums to the serial model's collective
    time, quantization to quant_time, whatever the micro-batches."""
    r = RECIPES[recipe]
    w = Workload(
        units=UNITS,
        compute_s=0.2,
        tokens_per_rank=64,
        stage=3,
        weights=r.weights,
        grads=r.grads,
        hpz=r.hpz,
        weight_diff=r.weight_diff,
        grad_accum=3,
        quant_rates=RATES,
    )
    c = Cluster(nodes=2, ranks_per_node=2, cross_gbps=1.0)
    units = unit_costs(w, c)
    a = w.grad_accum
    link = sum(a * (u.fwd.link_s + u.bwd.link_s + u.reduce.link_s) + u.post.link_s for u in units)
    quant = sum(a * (u.fwd.quant_s + u.bwd.quant_s + u.reduce.quant_s) + u.post.quant_s for u in units)
    assert link == pytest.approx(sum(collective_time(m, c) * m.count for m in messages(w, c)))
    assert quant == pytest.approx(quant_time(w, c))
    assert sum(a * (u.fwd_s + u.bwd_s) for u in units) == pytest.approx(w.compute_s)


@pytest.mark.parametrize("coalesce", [0, 10**9])
def test_keep_at_turn_drops_the_kept_units_backward_gathers_from_both_models(coalesce: int) -> None:
    """``keep_at_turn``: no backward gather of the root or of the last unit in the messages, their
    backward dequantization gone from the quantization time, the per-unit split still conserving
    both totals, and a shorter step than without it in both the serial and the scheduled model."""
    r = RECIPES["qwz"]
    base = Workload(
        units=UNITS,
        compute_s=0.2,
        tokens_per_rank=64,
        stage=3,
        weights=r.weights,
        grads=r.grads,
        grad_accum=2,
        coalesce=coalesce,
        quant_rates=RATES,
    )
    assert base.weights is not None and not base.hpz  # (qwZ alone: backward gathers are quantized)
    w = dataclasses.replace(base, keep_at_turn=True)
    assert w.kept_at_turn() == ({0, 1} if coalesce else {0, 3}) and base.kept_at_turn() == frozenset()  # (merged units)
    c = Cluster(nodes=2, ranks_per_node=2, cross_gbps=1.0)
    last = max(m.unit for m in messages(w, c))
    bwd = lambda x: sorted({m.unit for m in messages(x, c) if m.kind == "bwd_all_gather"})  # noqa: E731
    assert bwd(base) == list(range(last + 1)) and bwd(w) == list(range(1, last))
    units, a = unit_costs(w, c), w.grad_accum
    assert sum(a * (u.fwd.quant_s + u.bwd.quant_s + u.reduce.quant_s) + u.post.quant_s for u in units) == (
        pytest.approx(quant_time(w, c))
    )
    link = sum(a * (u.fwd.link_s + u.bwd.link_s + u.reduce.link_s) + u.post.link_s for u in units)
    assert link == pytest.approx(sum(collective_time(m, c) * m.count for m in messages(w, c)))
    assert quant_time(w, c) < quant_time(base, c)
    assert project(w, c).step_s < project(base, c).step_s
    assert project_scheduled(w, c).step_s < project_scheduled(base, c).step_s
    with pytest.raises(ValueError, match="keep_at_turn"):
        dataclasses.replace(base, stage=2, weights=None, keep_at_turn=True)


def test_a_coalesced_workload_is_modelled_as_its_merged_units() -> None:
    """``coalesce``: every model sees the units the engine moves (the merged spans, each padded as
    one), so the workload and its pre-merged twin project alike, and the merged unit's backward
    gather comes before the last block's backward, as the engine issues it."""
    r = RECIPES["qwz"]
    w = Workload(
        units=(1001, 333, 333, 333),
        compute_s=0.2,
        tokens_per_rank=64,
        stage=3,
        weights=r.weights,
        coalesce=700,
        quant_rates=RATES,
    )
    merged = w.coalesced()
    assert merged.units == (1001, 666, 333) and merged.coalesce == 0
    c = Cluster(nodes=2, ranks_per_node=2, cross_gbps=1.0)
    assert quant_time(w, c) == quant_time(merged, c)
    assert unit_costs(w, c) == unit_costs(merged, c) and len(unit_costs(w, c)) == 3
    assert project_scheduled(w, c).step_s == project_scheduled(merged, c).step_s
    assert dataclasses.replace(w, coalesce=0).coalesced().units == w.units


def test_prefetch_hides_compute_when_the_link_is_the_bottleneck() -> None:
    w = Workload(units=UNITS, compute_s=0.05, tokens_per_rank=64, stage=3, dtype_bytes=4)
    c = emulator_cluster(2, 2, 0.01, comm_on_compute=True, alpha_cross_s=0.0, alpha_intra_s=0.0)
    link = sum(message_transfer(m, c).link_s * m.count for m in messages(w, c))
    s0, s1 = (project_scheduled(w, c, prefetch=p).step_s for p in (0, 1))
    assert s1 < s0 and link <= s1 < link + w.compute_s  # with prefetch part of the compute is hidden
    serial = project(w, emulator_cluster(2, 2, 0.01, alpha_cross_s=0.0, alpha_intra_s=0.0))
    assert s1 < serial.step_s


@pytest.mark.parametrize("recipe", ["none", "zeropp"])
def test_calibrate_cpu_side_reproduces_the_unshaped_wait(recipe: str) -> None:
    r = RECIPES[recipe]
    w = Workload(
        units=UNITS,
        compute_s=0.0,
        tokens_per_rank=64,
        stage=3,
        weights=r.weights,
        grads=r.grads,
        hpz=r.hpz,
        dtype_bytes=4,
        quant_rates=RATES,
    )
    cal = calibrate_cpu_side(w, 2, 2, wait_s=0.2, loopback_gbps=3.0)
    c = emulator_cluster(
        2, 2, 3.0, comm_on_compute=True, **{k: cal[k] for k in ("alpha_cross_s", "alpha_intra_s", "intra_gbps")}
    )
    cpu = sum(message_transfer(m, c).compute_s * m.count for m in messages(w, c))
    cpu += (1 + 1) * c.alpha_cross_s  # the loss/norm all-reduce and the after-forward check
    assert cpu + quant_time(w, c) == pytest.approx(0.2)
    assert cal["scale"] > 0
    assert calibrate_cpu_side(w, 2, 2, wait_s=0.0, loopback_gbps=3.0)["scale"] == 0.0
    with pytest.raises(ValueError, match="loopback"):
        calibrate_cpu_side(w, 2, 2, wait_s=0.1, loopback_gbps=0.0)


def test_message_transfer_on_cpu_ranks_copies_every_sent_byte() -> None:
    w = Workload(units=(4000,), compute_s=0.0, tokens_per_rank=1, stage=3, grads=RECIPES["zeropp"].grads, dtype_bytes=4)
    c = emulator_cluster(2, 2, 1.0, comm_on_compute=True, alpha_cross_s=0.0, alpha_intra_s=0.0, intra_gbps=8.0)
    for m in messages(w, c):
        t = message_transfer(m, c)
        sent = (
            (m.nodes - 1) * m.chunk_bytes
            if m.algo == "a2a_cross"
            else (2 if m.algo == "ring_rs" else 1) * (m.nodes * m.ranks - 1) * m.chunk_bytes
        )
        assert t.compute_s == pytest.approx(sent / 1e9) and t.quant_s == 0.0
    gpu = dataclasses.replace(c, comm_on_compute=False)
    assert all(message_transfer(m, gpu) == Transfer(link_s=collective_time(m, gpu)) for m in messages(w, gpu))


def test_cli_prints_the_scheduled_table_and_refuses_overlap(capsys) -> None:
    from zeropp.experiments.projection import step_schedule

    step_schedule.main(["--plot", "", "--max-gpus", "16", "--gbps", "100"])
    out = capsys.readouterr().out
    assert "scheduled step" in out and out.count("\n") >= 5
    with pytest.raises(SystemExit):
        step_schedule.main(["--plot", "", "--overlap", "0.5"])
    assert "--overlap is the serial model's" in capsys.readouterr().err
