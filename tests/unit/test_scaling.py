"""The scaling cost model: exact message sizes, and the ZeRO++ paper's direction and size.

Here: the one-process checks of this topic. That ``scaling`` never imports its check
(``scaling_check``) is part of ``tests/unit/test_imports.py::test_no_import_cycles``.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from tests.codec_cases import registry_specs, spec_id
from zeropp.comm.spec import QuantSpec
from zeropp.experiments.projection.scaling import (
    collective_time,
    control_time,
    gpt_units,
    messages,
    node_cross_bytes,
    pairwise_bytes,
    project,
    quant_time,
    quant_work,
    uplink_bytes,
)
from zeropp.experiments.projection.spec import GBPS, Cluster, Workload
from zeropp.experiments.projection.speedup import ZEROPP, paper_workload, speedup_table
from zeropp.kernels import quantized_nbytes

INT8, INT4 = QuantSpec(bits=8), QuantSpec(bits=4)

UNITS = gpt_units(vocab=256, seq_len=64, d_model=64, n_layers=2)


def _w(**kw: object) -> Workload:
    return Workload(units=UNITS, compute_s=0.01, tokens_per_rank=512, dtype_bytes=4, **kw)  # type: ignore[arg-type]


def test_units_match_the_model() -> None:
    from zeropp.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=256, seq_len=64, d_model=64, n_layers=2, n_heads=2)
    assert sum(UNITS) == sum(p.numel() for p in GPT(cfg).parameters())
    assert UNITS[1] == sum(p.numel() for p in GPT(cfg).blocks[0].parameters())


def test_pairwise_bytes_equal_the_formulas() -> None:
    c = Cluster(nodes=2, ranks_per_node=2, cross_gbps=10)
    W = c.world
    shards = [-(-u // W) for u in UNITS]
    # plain ZeRO-3: each rank sends its shard to 1 intra and 2 cross peers, three times (fwd, bwd, grads)
    b = pairwise_bytes(messages(_w(), c))
    for kind in ("fwd_all_gather", "bwd_all_gather", "grad_reduce_scatter"):
        assert b[f"{kind}.intra"] == sum(4 * s for s in shards)
        assert b[f"{kind}.cross"] == 2 * sum(4 * s for s in shards)
    # qwZ INT8: the shard travels quantized (codes + one fp32 scale per 512)
    b = pairwise_bytes(messages(_w(weights=INT8), c))
    assert b["fwd_all_gather.cross"] == 2 * sum(quantized_nbytes(1, s, 8, 512) for s in shards)
    # hpZ: the backward gather never leaves the node
    b = pairwise_bytes(messages(_w(hpz=True), c))
    assert "bwd_all_gather.cross" not in b and b["bwd_all_gather.intra"] > 0
    # qgZ INT4: one quantized row per remote node, N rows to each local peer
    b = pairwise_bytes(messages(_w(grads=INT4), c))
    assert b["grad_reduce_scatter.cross"] == sum(quantized_nbytes(1, s, 4, 128) for s in shards)
    assert b["grad_reduce_scatter.intra"] == sum(quantized_nbytes(2, s, 4, 128) for s in shards)


def test_cross_node_volume_is_3m_vs_075m() -> None:
    """Per node, ZeRO-3 moves ~3M across nodes and ZeRO++ ~0.75M (fp16 -> INT8 weights, INT4 grads)."""
    w = Workload(units=(1 << 24,) * 4, compute_s=1.0, tokens_per_rank=1, dtype_bytes=2)
    c = Cluster(nodes=64, ranks_per_node=8, cross_gbps=100)
    m = sum(w.units) * 2
    base = node_cross_bytes(messages(w, c), c) / m
    plus = node_cross_bytes(messages(w.with_zero(**ZEROPP), c), c) / m
    assert base == pytest.approx(3 * 63 / 64, rel=1e-3)
    assert plus == pytest.approx(0.75 * 63 / 64, rel=0.05)  # scales cost a few percent


def test_paper_direction_and_size() -> None:
    """About 2x at 100 Gbps on hundreds of GPUs, much less at 400 Gbps, ~nothing on one node."""
    rows = speedup_table(paper_workload(), gbps=(100.0, 400.0), ranks_per_node=8, max_ranks=384)
    at = {(r["gbps"], r["gpus"]): r["speedup"] for r in rows}
    assert 1.6 < at[(100.0, 384)] < 2.6
    assert at[(400.0, 384)] < at[(100.0, 384)] - 0.4
    assert 1.0 <= at[(400.0, 384)] < 1.6
    assert at[(100.0, 8)] < 1.1  # one node: nothing crosses a NIC
    s100 = [at[(100.0, g)] for g in sorted(g for b, g in at if b == 100.0)]
    assert all(b >= a - 1e-9 for a, b in zip(s100, s100[1:]))  # grows with the number of nodes


def test_more_bandwidth_never_slower() -> None:
    w = paper_workload()
    for bw_lo, bw_hi in ((100, 200), (200, 400), (400, 800)):
        lo = project(w, Cluster(nodes=8, ranks_per_node=8, cross_gbps=bw_lo)).step_s
        hi = project(w, Cluster(nodes=8, ranks_per_node=8, cross_gbps=bw_hi)).step_s
        assert hi <= lo and math.isfinite(hi)


def _cross(b: dict[str, float]) -> float:
    return sum(v for k, v in b.items() if k.endswith(".cross"))


@pytest.mark.parametrize("nics", [None, 1, 2])
def test_uplink_carries_its_ranks_pairwise_bytes(nics: int | None) -> None:
    """A node's uplink carries (ranks sharing it) x one rank's pairwise cross-node bytes, and the
    link time of every cross-node collective is that over the uplink rate."""
    c = Cluster(
        nodes=3,
        ranks_per_node=4,
        cross_gbps=10,
        nics_per_node=nics,
        alpha_cross_s=0.0,
        alpha_intra_s=0.0,
        intra_gbps=1e9,
    )
    k = 4 // (nics or 4)
    assert c.ranks_per_uplink == k
    for w in (_w(), _w(**ZEROPP)):
        msgs = messages(w, c)
        assert uplink_bytes(msgs, c) == k * _cross(pairwise_bytes(msgs))
        for m in msgs:
            if m.nodes > 1:  # intra forwarding is free here, so the time is the uplink's alone
                assert collective_time(m, c) == pytest.approx(k * _cross(pairwise_bytes([m])) / m.count / (10 * GBPS))


def test_one_nic_per_rank_equals_a_ring_over_the_node() -> None:
    """With one NIC per rank the plain collectives take (n-1)/n of the buffer over one NIC's rate:
    the bandwidth-optimal ring's time, so the GPU projection keeps the paper's regime."""
    c = Cluster(nodes=8, ranks_per_node=8, cross_gbps=100, alpha_cross_s=0.0, intra_gbps=1e9)
    for m in messages(_w(), c):
        full = m.chunk_bytes * c.world
        assert collective_time(m, c) == pytest.approx((c.nodes - 1) / c.nodes * full / (100 * GBPS))
    shared = Cluster(nodes=8, ranks_per_node=8, cross_gbps=100, nics_per_node=1, alpha_cross_s=0.0, intra_gbps=1e9)
    m = messages(_w(), c)[0]
    assert collective_time(m, shared) == pytest.approx(8 * collective_time(m, c))


def test_bad_nic_count_is_rejected() -> None:
    with pytest.raises(ValueError, match="nics_per_node"):
        Cluster(nodes=2, ranks_per_node=4, cross_gbps=1, nics_per_node=3)


def test_quantization_work_and_time_follow_the_schedule() -> None:
    """Elements per op = what zeropp.comm quantizes per unit; time = elements x bytes / measured rate."""
    c = Cluster(nodes=2, ranks_per_node=2, cross_gbps=10)
    W, S = c.world, sum(-(-u // c.world) for u in UNITS)
    w = _w(**ZEROPP)
    assert quant_work(w, c) == {
        ("quantize", 8): S,
        ("dequantize", 8): W * S,  # qwZ fwd only (hpZ)
        ("quantize", 4): W * S,
        ("dequantize_sum_requantize", 4): W * S,
        ("dequantize_sum", 4): 2 * S,
    }
    assert quant_work(_w(weights=INT8), c) == {("quantize", 8): 2 * S, ("dequantize", 8): 2 * W * S}  # fwd + bwd
    assert quant_work(_w(), c) == {} and quant_time(_w(), c) == 0.0
    rates = (("quantize", 8, 0.5), ("dequantize", 8, 2.0), ("quantize", 4, 0.25))
    wr = w.with_zero(quant_rates=rates, quant_gbs=1.0)
    expect = 4 * (S / 0.5 + W * S / 2.0 + W * S / 0.25 + W * S / 1.0 + 2 * S / 1.0) / 1e9
    assert quant_time(wr, c) == pytest.approx(expect)
    p = project(wr, c)
    assert p.quant_s == pytest.approx(expect)
    assert p.comm_s == pytest.approx(
        sum(collective_time(m, c) * m.count for m in messages(wr, c)) + control_time(wr, c) + expect
    )


def test_measured_quant_rates_cover_every_op_and_charge_time() -> None:
    from zeropp.experiments.projection.calibration import measure_quant_rates
    from zeropp.experiments.projection.scaling_check import emulator_cluster

    c = emulator_cluster(2, 2, 1.0)
    w = _w(**ZEROPP)
    rates = measure_quant_rates(w, c, repeats=1)
    assert {(op, b) for op, b, _ in rates} == set(quant_work(w, c))
    assert all(0 < g < math.inf for _, _, g in rates)
    assert project(w.with_zero(quant_rates=rates), c).quant_s > 0


def test_spec_group_size_and_hop_bits_set_the_messages() -> None:
    """The spec's group size replaces the kernels' default; ``intra_bits`` is the intra hop's width."""
    c = Cluster(nodes=2, ranks_per_node=2, cross_gbps=10)
    shards = [-(-u // c.world) for u in UNITS]
    b = pairwise_bytes(messages(_w(weights=QuantSpec(bits=4, group_size=64)), c))
    assert b["fwd_all_gather.cross"] == 2 * sum(quantized_nbytes(1, s, 4, 64) for s in shards)
    w = _w(grads=QuantSpec(bits=4, intra_bits=8, group_size=256))
    assert (w.weight_group_size, w.grad_group_size) == (512, 256)
    b = pairwise_bytes(messages(w, c))
    assert b["grad_reduce_scatter.intra"] == sum(quantized_nbytes(2, s, 8, 256) for s in shards)
    assert b["grad_reduce_scatter.cross"] == sum(quantized_nbytes(1, s, 4, 256) for s in shards)
    assert quant_work(w, c) == {
        ("quantize", 8): c.world * sum(shards),
        ("dequantize_sum_requantize", 8): c.world * sum(shards),
        ("dequantize_sum", 4): 2 * sum(shards),
    }


def test_workload_from_zero_config() -> None:
    from zeropp.runtime import ZeroConfig

    z = ZeroConfig(
        stage=3,
        weights=INT8,
        grads=QuantSpec(bits=4, intra_bits=8),
        hpz=True,
        hpz_size=2,
        precision="bf16",
        grad_accum_steps=3,
    )
    w = Workload.from_zero(z, units=UNITS, compute_s=0.5, tokens_per_rank=64, overlap=0.25)
    assert (w.stage, w.weights, w.grads, w.hpz, w.hpz_size) == (3, z.weights, z.grads, True, 2)
    assert (w.dtype_bytes, w.grad_accum, w.overlap, w.units) == (2, 3, 0.25, UNITS)
    assert Workload.from_zero(ZeroConfig(stage=1), units=UNITS, compute_s=0, tokens_per_rank=1).dtype_bytes == 4


def _summary(cluster: dict) -> dict:
    """A summary.json of the runner's layout: summary["config"] holds asdict() of the library configs."""
    zero = {
        "stage": 3,
        "precision": "fp32",
        "hpz": True,
        "hpz_size": None,
        "grad_accum_steps": 2,
        "weights": dataclasses.asdict(INT8),
        "grads": dataclasses.asdict(QuantSpec(bits=4, group_size=64)),
    }
    cfg = {
        "zero": zero,
        "model": {"vocab_size": 256, "seq_len": 64, "d_model": 64, "n_layers": 2, "n_heads": 2, "mlp_ratio": 4},
        "topology": {"nodes": 2, "ranks_per_node": 2, "hpz_size": None},
        "train": {"micro_batch_size": 4},
        "trainer": {"name": "zeropp"},
        "cluster": cluster,
    }
    return {
        "config": cfg,
        "label": "run",
        "step_time_s": {"mean": 0.5},
        "engine_comm_wait_s_per_step": 0.2,
        "comm_wait_s_per_step": 0.3,
        "model": {"flops_per_token": 7.0},
    }


def test_workload_from_summary_reads_the_run_config() -> None:
    from zeropp.experiments.projection.scaling_check import workload_from_summary

    w = workload_from_summary(_summary({"name": "local"}), (("quantize", 8, 1.0),))
    assert w.compute_s == pytest.approx(0.5 - 0.2)  # step - the engine's own wait
    expect = Workload(
        units=UNITS,
        compute_s=0.0,
        tokens_per_rank=4 * 2 * 64,
        stage=3,
        weights=INT8,
        grads=QuantSpec(bits=4, group_size=64),
        hpz=True,
        dtype_bytes=4,
        grad_accum=2,
        flops_per_token=7.0,
        quant_rates=(("quantize", 8, 1.0),),
    )
    assert dataclasses.replace(w, compute_s=0.0) == expect


def test_compare_measured_takes_the_link_from_the_summary() -> None:
    """Emulated runs: the measured link rate from the placement; local runs need cross_gbps."""
    from zeropp.experiments.projection.scaling_check import compare_measured, workload_from_summary

    s = _summary({"name": "emulated", "inter_gbps": 1.0, "inter_latency_ms": 0.0})
    s["placement"] = {"cluster": "emulated", "measured_gbps": 0.8}
    c = Cluster(nodes=2, ranks_per_node=2, cross_gbps=0.8)
    pw = pairwise_bytes(messages(workload_from_summary(s), c))
    by_link = {"cross": _cross(pw), "intra": sum(v for k, v in pw.items() if k.endswith(".intra"))}
    s["engine_comm_bytes_per_step"] = {"by_link": by_link}
    (row,) = compare_measured([s], quant_rates=())
    assert row["cross_gbps"] == 0.8 and row["bytes_error"] == 0 and row["intra_bytes_error"] == 0
    assert row["predicted_quant_s"] == pytest.approx(quant_time(workload_from_summary(s), c))  # at quant_gbs
    assert row["measured_comm_s"] == 0.2
    local = {**s, "config": {**s["config"], "cluster": {"name": "local"}}}
    with pytest.raises(ValueError, match="cross_gbps"):
        compare_measured([local], quant_rates=())
    assert compare_measured([local], quant_rates=(), cross_gbps=2.0)[0]["cross_gbps"] == 2.0


def test_runs_that_share_a_label_are_told_apart_and_zero_bytes_of_zero_is_exact(tmp_path, capsys) -> None:
    """Two sweeps' runs that differ only in train.steps share the summary label ``run``: each row
    gets what sets its run apart, whole (before: four rows reading alike, cut at 34 characters);
    a run that sends no cross-node bytes, predicted as none, reads 0.0% (before: nan%); jobs in
    Hydra's order (2 before 10)."""
    import json

    from zeropp.experiments.projection.scaling_check import compare_measured, main

    runs = []
    for job, steps in ((2, 3), (10, 5)):
        s = _summary({"name": "local"})
        s["config"]["train"]["steps"] = steps
        s["overrides"] = [f"train.steps={steps}"]
        s["comm_bytes_per_step"] = {"by_link": {"cross": 0, "intra": 0}}
        (tmp_path / str(job)).mkdir()
        (tmp_path / str(job) / "summary.json").write_text(json.dumps(s))
        runs.append(s)
    one_node = {**runs[0], "config": {**runs[0]["config"], "topology": {"nodes": 1, "ranks_per_node": 2}}}
    (row,) = compare_measured([one_node], quant_rates=(), cross_gbps=1.0)
    assert row["measured_cross_bytes"] == row["predicted_cross_bytes"] == 0 and row["bytes_error"] == 0.0
    main([str(tmp_path), "--cross-gbps", "1"])
    lines = capsys.readouterr().out.splitlines()[3:]
    assert [line.split(")")[0] for line in lines] == ["run (train.steps=3", "run (train.steps=5"], lines


def test_runs_of_a_link_rate_sweep_each_show_their_own_rate() -> None:
    """Emulated runs at 1 and 10 Gbit/s: the links line lists both and each row names its own
    (before: the line named the first row's rate for every row)."""
    from zeropp.experiments.projection.scaling_check import compare_measured, links_line

    runs = []
    for gbps in (1.0, 10.0):
        s = _summary({"name": "emulated", "inter_gbps": gbps, "inter_latency_ms": 0.0})
        s["comm_bytes_per_step"] = {"by_link": {"cross": 1, "intra": 1}}
        runs.append(s)
    rows = compare_measured(runs, quant_rates=())
    assert links_line(rows).startswith("links: cross 1, 10 Gbit/s (per run: see each row)")
    assert [r["label"] for r in rows] == ["run @ 1 Gbit/s", "run @ 10 Gbit/s"]
    (one,) = compare_measured(runs[:1], quant_rates=())
    assert links_line([one]).startswith("links: cross 1 Gbit/s, intra") and one["label"] == "run"


@pytest.mark.parametrize("rate", [0, -1, "abc", 1e-320, True])
def test_a_damaged_link_rate_in_a_summary_is_one_error_naming_the_run(rate, tmp_path, capsys) -> None:
    """An emulated run's summary.json whose link rate is 0, negative, a string, subnormal or a bool:
    before, a TypeError traceback ('abc'), a ``predicted inf`` row with exit 0 (1e-320), or
    ``invalid cluster Cluster(...)`` with exit 1 naming neither the file nor the key."""
    import json

    from zeropp.experiments.projection.scaling_check import main

    s = _summary({"name": "emulated", "inter_gbps": rate, "inter_latency_ms": 0.0})
    s["placement"] = {"measured_gbps": rate}
    s["comm_bytes_per_step"] = {"by_link": {"cross": 1, "intra": 1}}
    (tmp_path / "moved").mkdir()
    (tmp_path / "moved" / "summary.json").write_text(json.dumps({**s, "run_dir": "/elsewhere"}))
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"error: run {tmp_path / 'moved'}: "), err
    assert "is not a link rate" in err and "--cross-gbps" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "kw, word",
    [
        ({"stage": 5}, "stage"),
        ({"stage": 2, "weights": INT8}, "weights"),
        ({"stage": 1, "hpz": True}, "hpz"),
        ({"stage": 0, "grads": INT4}, "grads"),
        ({"dtype_bytes": 3}, "dtype_bytes"),
        ({"overlap": 1.5}, "overlap"),
        ({"units": ()}, "units"),
    ],
)
def test_bad_workload_is_rejected(kw: dict, word: str) -> None:
    with pytest.raises(ValueError, match=f"Workload.{word}="):
        Workload(**{"units": UNITS, "compute_s": 0.0, "tokens_per_rank": 1, **kw})


@pytest.mark.parametrize("spec", registry_specs(group_size=64), ids=spec_id)
def test_measured_quant_rates_time_every_registered_codec(spec: QuantSpec) -> None:
    """The kernel timing runs each op through the spec's codec: a 6-bit MX or a 4-bit NVFP4
    workload is timed (the int kernels have no 6-bit path), one rate per op of quant_work."""
    from zeropp.experiments.projection.calibration import measure_quant_rates
    from zeropp.experiments.projection.scaling_check import emulator_cluster

    c = emulator_cluster(2, 2, 1.0)
    w = _w(weights=spec, grads=spec)
    rates = measure_quant_rates(w, c, repeats=1)
    assert {(op, b) for op, b, _ in rates} == set(quant_work(w, c))
    assert all(0 < g < math.inf for _, _, g in rates)
