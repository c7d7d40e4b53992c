"""The calibrated cluster file: the latency-bandwidth fit on synthetic sweeps, the file's round trip
and refusals, and the projection reading it (against hand computation), with quantization rates
keyed by (op, format)."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from zeropp.comm.spec import QuantSpec
from zeropp.experiments.projection.cluster_file import (
    ClusterFile,
    ClusterFileError,
    LinkFit,
    fit_alpha_beta,
    link_fit,
    read_cluster_file,
    write_cluster_file,
)
from zeropp.experiments.projection.scaling import (
    collective_time,
    format_name,
    messages,
    quant_time,
    quant_work,
    quant_work_formats,
)
from zeropp.experiments.projection.spec import GBPS, Cluster, Message, Workload
from zeropp.experiments.projection.speedup import speedup_table

SIZES = [1024 * 4**k for k in range(8)]


def test_the_fit_recovers_a_known_latency_and_bandwidth() -> None:
    a, b = 250e-6, 1 / (3.0 * GBPS)  # 250 us, 3 Gbit/s
    assert fit_alpha_beta(SIZES, [a + b * x for x in SIZES]) == pytest.approx((a, b), rel=1e-9)
    rng = random.Random(0)  # 1% multiplicative noise still lands within a few percent
    noisy = [(a + b * x) * (1 + 0.01 * rng.uniform(-1, 1)) for x in SIZES]
    fa, fb = fit_alpha_beta(SIZES, noisy)
    assert fb == pytest.approx(b, rel=0.03) and fa == pytest.approx(a, rel=0.3)
    # as a LinkFit of a 4-rank ring: the intercept over its 3 message steps, bandwidth in Gbit/s
    f = link_fit(4, SIZES, [a + b * x for x in SIZES])
    assert f.alpha_s == pytest.approx(a / 3) and f.gbps == pytest.approx(3.0) and f.points == len(SIZES)


def test_the_fit_refuses_a_sweep_that_never_left_the_latency_floor() -> None:
    with pytest.raises(ValueError, match="--max-bytes"):
        fit_alpha_beta(SIZES, [1e-3 - 1e-12 * x for x in SIZES])
    with pytest.raises(ValueError, match="distinct sizes"):
        fit_alpha_beta([1024, 1024], [1e-3, 2e-3])


def _file(**kw) -> ClusterFile:
    base = dict(
        nodes=2,
        ranks_per_node=2,
        backend="gloo",
        links={
            "intra": LinkFit(alpha_s=40e-6, gbps=2.5, ranks=2, points=7),
            "inter": LinkFit(alpha_s=120e-6, gbps=0.9, ranks=4, points=7),
        },
        quant_rates=(("quantize", "int8", 3.0), ("quantize", "mxfp4", 0.5), ("dequantize", "int8", 9.0)),
        source={"command": "python -m experiments.bench_comm --calibrate x"},
    )
    return ClusterFile(**{**base, **kw})


def test_a_cluster_file_round_trips(tmp_path) -> None:
    p = tmp_path / "c.json"
    write_cluster_file(p, _file())
    assert read_cluster_file(p) == _file()
    write_cluster_file(p, _file(backend="nccl"))  # our own file may be rewritten
    assert read_cluster_file(p).backend == "nccl"


def _edit(tmp_path, change) -> str:
    d = _file().to_json()
    change(d)
    p = tmp_path / "c.json"
    p.write_text(json.dumps(d))
    return str(p)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d["links"]["intra"].pop("gbps"), "links.intra has no 'gbps'"),
        (lambda d: d.pop("quant_rates"), "has no 'quant_rates'"),
        (lambda d: d.update(version=2), "version 2, this zeropp reads version 1"),
        (lambda d: d["links"]["inter"].update(gbps=-1.0), "a bandwidth is a finite rate > 0"),
        (lambda d: d["links"]["inter"].update(alpha_s=-1e-6), "a latency is a finite number"),
        (lambda d: d["quant_rates"][0].update(gbs=0), "GB/s > 0"),
        (lambda d: d["links"].update(nvlink=d["links"]["intra"]), "give one or more of"),
        (lambda d: d.pop("kind"), "is not a cluster file"),
        # finite figures the cost model turns into inf / nan step times (before: a table of inf and
        # 'nanx', exit 0), and JSON values of the wrong type that Python would have taken
        (lambda d: d["links"]["inter"].update(gbps=1e-320), r"LinkFit.gbps=1e-320; .* from 1e-06 to 100000"),
        (lambda d: d["links"]["inter"].update(gbps=1e308), r"LinkFit.gbps=1e\+308"),
        (lambda d: d["links"]["inter"].update(alpha_s=1e308), r"alpha_s=1e\+308; .* <= 10"),
        (lambda d: d["links"]["inter"].update(gbps=True), "LinkFit.gbps=True"),
        (lambda d: d["quant_rates"][0].update(gbs="1e-300"), r"'1e-300'\); a rate is"),
        (lambda d: d["quant_rates"][0].update(gbs=1e-320), "from 1e-06 to 100000 GB/s"),
        (lambda d: d["quant_rates"][0].pop("gbs"), "a quant_rates entry has no 'gbs'"),
        (lambda d: d.update(nodes=float("nan")), "nodes=nan, .* whole numbers"),
        (lambda d: d.update(ranks_per_node=1.5), "ranks_per_node=1.5; use whole numbers"),
        (lambda d: d["links"]["inter"].update(ranks=float("nan")), "ranks=nan, .*whole numbers"),
        (lambda d: d.update(backend=["gloo"]), "ClusterFile.backend="),
        # a rate under an op or format the model never looks up was silently ignored
        (lambda d: d["quant_rates"][0].update(op="bogus"), "the op is one of quantize, dequantize"),
        (lambda d: d["quant_rates"][0].update(format="int3"), "the format one of fp8, int4, int8"),
        # hand edits nothing would read (before: accepted, the key dropped, the earlier rate dropped)
        (lambda d: d.update(intra_gbps=100), r"the file has the key\(s\) 'intra_gbps', which nothing reads"),
        (lambda d: d["links"]["inter"].update(alpha_us=5), r"links.inter has the key\(s\) 'alpha_us'"),
        (lambda d: d["quant_rates"][1].update(bits=4), r"a quant_rates entry has the key\(s\) 'bits'"),
        (
            lambda d: d["quant_rates"].append({"op": "quantize", "format": "int8", "gbs": 30.0}),
            r"\('quantize', 'int8'\) more than once, and the model would read only the last",
        ),
        # a link's ranks is the group its class is fitted on (before: any count >= 2 was taken)
        (lambda d: d["links"]["intra"].update(ranks=3), r"links.intra.ranks=3, but the intra link is fitted on one"),
        (lambda d: d["links"]["inter"].update(ranks=2), r"links.inter.ranks=2, .* the world: 4 ranks of nodes=2"),
        (lambda d: d.update(nodes=1), r"links.inter is given but nodes=1: one node has no cross-node link"),
        (lambda d: d.update(ranks_per_node=1), r"links.intra is given but ranks_per_node=1: a node of one rank"),
        (lambda d: d.update(nodes=4), r"links.inter.ranks=4, .* 8 ranks of nodes=4 x ranks_per_node=2"),
        (  # an earlier spelling is the same format: two rates for one (op, format)
            lambda d: d["quant_rates"].append({"op": "quantize", "format": "mx4", "gbs": 30.0}),
            r"\('quantize', 'mxfp4'\) more than once",
        ),
    ],
)
def test_a_bad_cluster_file_is_refused_with_the_key(tmp_path, change, message) -> None:
    with pytest.raises(ClusterFileError, match=message) as e:
        read_cluster_file(_edit(tmp_path, change))
    assert "c.json" in str(e.value)


def test_a_key_given_twice_is_refused_not_dropped(tmp_path) -> None:
    """JSON keeps the last of two equal keys: a second ``intra`` link (or ``nodes``) pasted in was read
    and the first dropped without a word."""
    text = json.dumps(_file().to_json(), indent=1)
    intra = json.dumps(_file().to_json()["links"]["intra"])
    p = tmp_path / "c.json"
    p.write_text(text.replace('"links": {', '"links": {"intra": ' + intra.replace("2.5", "9.0") + ",", 1))
    with pytest.raises(ClusterFileError, match=r"c.json: invalid cluster file: the key 'intra' is given twice"):
        read_cluster_file(p)
    p.write_text(text.replace('"nodes": 2,', '"nodes": 2, "nodes": 3,', 1))
    with pytest.raises(ClusterFileError, match="the key 'nodes' is given twice"):
        read_cluster_file(p)


def test_a_file_with_the_earlier_mx_spellings_reads_as_the_spec_names(tmp_path) -> None:
    """Files calibrated when the MX float formats were keyed ``mx4`` / ``mx8``: read under the names
    the benchmark and the spec's recipes use now, so their rates are still looked up."""

    def earlier(d: dict) -> None:
        d["quant_rates"][1]["format"] = "mx4"
        d["quant_rates"].append({"op": "dequantize", "format": "mx8", "gbs": 7.0})

    got = read_cluster_file(_edit(tmp_path, earlier))
    assert got == _file(quant_rates=(*_file().quant_rates, ("dequantize", "mxfp8", 7.0)))


def test_unreadable_and_foreign_files(tmp_path) -> None:
    with pytest.raises(ClusterFileError, match="cannot read cluster file"):
        read_cluster_file(tmp_path / "missing.json")
    junk = tmp_path / "junk.json"
    junk.write_text("{not json")
    with pytest.raises(ClusterFileError, match="is not JSON"):
        read_cluster_file(junk)
    with pytest.raises(ClusterFileError, match="is not a cluster file"):  # a file we did not write stays
        write_cluster_file(junk, _file())
    assert junk.read_text() == "{not json"


def test_the_cluster_takes_the_files_links_by_hand() -> None:
    cf = _file()
    c = cf.cluster(Cluster(nodes=2, ranks_per_node=2, cross_gbps=100.0, nics_per_node=1, wire="ring"))
    assert (c.alpha_intra_s, c.intra_gbps, c.alpha_cross_s, c.cross_gbps) == (40e-6, 2.5, 120e-6, 0.9)
    # an all-gather over the world (ring wire): 3 steps x alpha_cross, 3 chunks on the uplink at 0.9
    # Gbit/s beside 3 chunks through the loopback at 2.5 Gbit/s (parallel links: the longer)
    m = Message("all_gather", "ring_ag", 2, 2, 1 << 20, 1)
    assert collective_time(m, c) == pytest.approx(3 * 120e-6 + 3 * (1 << 20) / (0.9 * GBPS))
    intra = Message("all_gather", "ring_ag", 1, 2, 1 << 20, 1)
    assert collective_time(intra, c) == pytest.approx(40e-6 + (1 << 20) / (2.5 * GBPS))


def test_quant_rates_are_keyed_by_format_and_old_bit_keys_still_work() -> None:
    """MXFP4 weights and INT4 gradients are both 4 bits: a (op, format) rate tells them apart."""
    c = Cluster(nodes=2, ranks_per_node=2, cross_gbps=1.0)
    w = Workload(
        units=(4096, 8192),
        compute_s=0.0,
        tokens_per_rank=1,
        dtype_bytes=4,
        weights=QuantSpec(scheme="mx", bits=4),
        grads=QuantSpec(bits=4),
    )
    by_fmt = quant_work_formats(w, c)
    assert {f for _, _, f in by_fmt} == {"mxfp4", "int4"} and format_name(
        QuantSpec(scheme="nvfp4", bits=4), 4
    ) == "nvfp4"
    q_mx = by_fmt[("quantize", 4, "mxfp4")]
    q_int = by_fmt[("quantize", 4, "int4")]
    assert quant_work(w, c)[("quantize", 4)] == q_mx + q_int  # the old view sums the formats
    rates = (("quantize", "mxfp4", 0.5), ("quantize", 4, 2.0))
    others = sum(n for (op, _, _), n in by_fmt.items() if op != "quantize")
    hand = (q_mx * 4 / 0.5e9) + (q_int * 4 / 2.0e9) + others * 4 / (w.quant_gbs * 1e9)
    assert quant_time(dataclasses.replace(w, quant_rates=rates), c) == pytest.approx(hand)
    # bits-keyed rates alone (calibration.measure_quant_rates' tuples) charge both formats alike
    bits_only = (("quantize", 4, 2.0),)
    hand = (q_mx + q_int) * 4 / 2.0e9 + others * 4 / (w.quant_gbs * 1e9)
    assert quant_time(dataclasses.replace(w, quant_rates=bits_only), c) == pytest.approx(hand)


def test_the_projection_table_reads_the_file() -> None:
    from zeropp.experiments.projection.scaling import project
    from zeropp.experiments.projection.speedup import ZEROPP, paper_workload

    cf = _file()
    w = paper_workload(tokens_per_gpu=1024, achieved_tflops=50.0)
    rows = speedup_table(w, gbps=(100.0, 400.0), ranks_per_node=2, max_ranks=4, cluster_file=cf)
    assert {r["gbps"] for r in rows} == {0.9}  # the file's inter-node rate replaces --gbps
    c = cf.cluster(Cluster(nodes=2, ranks_per_node=2, cross_gbps=0.9))
    plus = dataclasses.replace(w.with_zero(**ZEROPP), quant_rates=cf.quant_rates)
    row = next(r for r in rows if r["nodes"] == 2)
    assert row["zeropp_step_s"] == pytest.approx(project(plus, c).step_s)
    assert messages(plus, c)  # the workload is a real one


def test_the_scaling_cli_refuses_a_bad_file(tmp_path, capsys) -> None:
    from zeropp.experiments.projection.speedup import main

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"kind": "zeropp-cluster", "version": 7}))
    with pytest.raises(SystemExit) as e:
        main(["--cluster-file", str(bad), "--plot", ""])
    assert e.value.code == 2 and "version 7" in capsys.readouterr().err


def test_the_scaling_cli_refuses_a_gbps_the_files_rate_replaces(tmp_path, capsys) -> None:
    """``scaling --gbps 5 --cluster-file c.json``: the file's inter-node rate replaced the typed one
    silently (the table's rows were at 0.9 Gbit/s). A file without an inter-node fit keeps --gbps."""
    from zeropp.experiments.projection.speedup import main

    p = tmp_path / "c.json"
    write_cluster_file(p, _file())
    with pytest.raises(SystemExit) as e:
        main(["--gbps", "5", "--cluster-file", str(p), "--plot", ""])
    assert e.value.code == 2 and "--gbps 5 does nothing with --cluster-file" in capsys.readouterr().err
    write_cluster_file(p, _file(links={"intra": LinkFit(alpha_s=40e-6, gbps=2.5)}))
    main(["--gbps", "5", "--cluster-file", str(p), "--plot", "", "--max-gpus", "16"])
    assert "     5 " in capsys.readouterr().out
