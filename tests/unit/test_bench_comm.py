"""``python -m experiments.bench_comm``'s pure parts: nccl-tests' bus-bandwidth factors against
the bytes a ring / pairwise schedule sends, the size sweep, the command line's refusals, and
``--calibrate``'s fit of a result (synthetic rows from a known latency and bandwidth)."""

from __future__ import annotations

import json

import pytest

from zeropp.experiments.bench import comm
from zeropp.experiments.bench.comm_rank import OPS, CommBenchSpec, busbw_factor, format_specs
from zeropp.experiments.projection.cluster_file import read_cluster_file


def _ring_sent(op: str, n: int, size: int) -> float:
    """Bytes one rank sends for a collective of ``size`` bytes over ``n`` ranks, counted step by
    step: a ring all-gather / reduce-scatter passes one ``size / n`` chunk per step for ``n - 1``
    steps, a ring all-reduce is the two back to back, an all-to-all sends each peer its chunk."""
    chunk = size / n
    steps = {"all_gather": n - 1, "reduce_scatter": n - 1, "all_reduce": 2 * (n - 1)}
    if op == "all_to_all":
        return sum(chunk for peer in range(n) if peer != 0)
    return sum(chunk for _ in range(steps[op]))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("n", [2, 3, 4, 8, 16])
def test_busbw_is_the_bytes_each_rank_sends_over_the_time(op: str, n: int) -> None:
    size, t = 1 << 20, 0.01
    assert (size / t) * busbw_factor(op, n) == pytest.approx(_ring_sent(op, n, size) / t)


def test_busbw_factor_refuses_an_unknown_collective() -> None:
    with pytest.raises(ValueError, match="unknown collective 'broadcast'"):
        busbw_factor("broadcast", 4)


def test_sizes_and_their_spelling() -> None:
    assert comm.size_sweep(1024, 1 << 30, 4) == tuple(1024 * 4**k for k in range(11))
    assert comm.size_sweep(1024, 5000, 2) == (1024, 2048, 4096)
    assert [comm.parse_bytes(s) for s in ("1024", "64K", "4M", "1G", "2MiB")] == [
        1024,
        1 << 16,
        1 << 22,
        1 << 30,
        2 << 20,
    ]
    with pytest.raises(ValueError, match="not a size"):
        comm.parse_bytes("lots")
    with pytest.raises(ValueError, match="--step 2 or 4"):
        comm.size_sweep(1024, 4096, 3)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--formats", "int8,fp3"], "unknown wire format"),
        # before: --ops / --groups measured twice (the same rows again); --formats silently once
        (["--ops", "all_gather,all_reduce,all_gather"], "'all_gather,all_reduce,all_gather' names all_gather more"),
        (["--groups", "world,world"], "names world more than once; name each once"),
        (["--formats", "int8,mxfp4,int8"], "--formats int8,mxfp4,int8 names a format more than once"),
        (["--formats", "mx4,mxfp4"], "--formats mx4,mxfp4 names a format more than once (mx4 / mx6 / mx8 are earlier"),
        (["--ops", "all_gather,broadcast"], "comma-separated subset"),
        (["--step", "3"], "--step 2 or 4"),
        (["--nodes", "1", "--ranks-per-node", "1"], "needs >= 2 ranks"),
        (["--min-bytes", "1M", "--max-bytes", "4K"], "--min-bytes <= --max-bytes"),
        (["--cluster", "emulated", "--nodes", "1", "--ranks-per-node", "4"], "--nodes >= 2"),
        (["--calibrate", "x.json", "--ops", "all_reduce"], "keep all_gather"),
        (["--iters", "0"], "iters=0"),
        # before: "invalid parse_bytes value: '1.5K'", without the spellings to use
        (["--min-bytes", "1.5K"], "argument --min-bytes: '1.5K' is not a size; use e.g. 1024, 64K, 4M, 1G"),
        (["--max-bytes", "2"], "argument --max-bytes: size '2' is below one fp32 element (4 bytes)"),
        # before: 4, 8 and 16 bytes were each measured at 16 (one element per rank): three equal rows
        (["--min-bytes", "8", "--step", "2"], "--min-bytes 8 is less than one fp32 element per rank of the 4-rank"),
        # before: accepted, and the world started (and failed), or the flag was silently ignored
        (["--timeout", "0"], "--timeout must be a finite number of seconds > 0, got 0"),
        (["--gbps", "5"], "--gbps shape(s) the links of --cluster emulated; with --cluster local nothing is shaped"),
        (["--latency-ms", "3"], "--latency-ms shape(s) the links of --cluster emulated"),
        (["--cluster", "emulated", "--gbps", "inf"], "a finite --gbps > 0, got 2 and inf"),
        # before: an empty table, exit 0
        (["--groups", "inter", "--nodes", "1"], "--groups inter: with --nodes 1 x --ranks-per-node 2 the inter group"),
        (["--groups", "intra", "--nodes", "1"], "the intra group holds all the ranks, as world does"),
    ],
)
def test_the_command_line_refuses_with_usage_exit_2(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        comm.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_default_formats_are_every_registered_scheme_and_width() -> None:
    from zeropp.comm.spec import schemes

    assert len(format_specs()) == sum(len(b) for b in schemes().values())
    a = comm.parse_args(["--formats", "none"])
    assert a.spec.formats == () and a.spec.sizes[-1] == comm.CPU_MAX_BYTES  # this host has no GPU
    spec = CommBenchSpec(nodes=2, ranks_per_node=2, formats=("int8",), sizes=(1024, 4096))
    assert CommBenchSpec.from_json(json.loads(json.dumps(spec.__dict__))) == spec


@pytest.mark.parametrize("recipe", ["int8", "int4", "fp8", "mxfp8", "mxfp6", "mxfp4", "mxint8", "nvfp4"])
def test_wire_format_names_are_the_spec_recipes_names(recipe: str) -> None:
    """The table's and ``--formats``' name of a format is the name of the ``quant=`` recipe that sends
    it (``zeropp.comm.spec.RECIPES``): ``mxfp4`` names MXFP4 everywhere (before: ``mx4`` here)."""
    from zeropp.comm.spec import RECIPES

    want = RECIPES[recipe].weights
    assert want is not None
    got = format_specs((recipe,))
    assert list(got) == [recipe] and (got[recipe].scheme, got[recipe].bits) == (want.scheme, want.bits)


def test_the_earlier_mx_spellings_are_accepted_as_the_spec_names() -> None:
    a = comm.parse_args(["--formats", "int8,mx4,mx6,mx8", "--max-bytes", "4K"])
    assert a.spec.formats == ("int8", "mxfp4", "mxfp6", "mxfp8")  # the names the table prints


def _result(alpha_step: float, gbps: float, nodes: int = 2, rpn: int = 2) -> dict:
    """A benchmark result whose plain all-gathers take exactly ``(n-1) alpha + bus bytes / rate``."""
    rows = []
    for group, n in (("world", nodes * rpn), ("intra", rpn), ("inter", nodes)):
        if n < 2:
            continue
        for size in (1 << 12, 1 << 16, 1 << 20, 1 << 22):
            t = (n - 1) * alpha_step + size * (n - 1) / n / (gbps * 1e9 / 8)
            algbw = size / t / 1e9
            row = {"group": group, "ranks": n, "op": "all_gather", "format": "plain", "bytes": size, "seconds": t}
            rows.append({**row, "algorithm": "ring", "algbw_gbs": algbw, "busbw_gbs": algbw * (n - 1) / n})
            rows.append({**rows[-1], "format": "int8", "seconds": t / 2})  # not fitted: only plain rows are
    rates = [{"op": "quantize", "format": "int8", "gbs": 4.0}]
    return {"backend": "gloo", "nodes": nodes, "ranks_per_node": rpn, "rows": rows, "quant_rates": rates}


def test_calibrate_fits_each_link_class_on_the_plain_all_gathers(tmp_path) -> None:
    cf = comm.calibrate(_result(200e-6, 2.0))
    assert cf.links["intra"].alpha_s == pytest.approx(200e-6) and cf.links["intra"].gbps == pytest.approx(2.0)
    assert cf.links["inter"].ranks == 4 and cf.links["inter"].gbps == pytest.approx(2.0)
    assert cf.quant_rates == (("quantize", "int8", 4.0),)
    one_node = comm.calibrate(_result(50e-6, 8.0, nodes=1, rpn=4))  # one node: intra from the world, no inter
    assert set(one_node.links) == {"intra"} and one_node.links["intra"].alpha_s == pytest.approx(50e-6)
    res = _result(200e-6, 2.0)
    res["rows"] = [r for r in res["rows"] if r["group"] != "intra"]
    with pytest.raises(ValueError, match="no plain all-gather over the 'intra' group"):
        comm.calibrate(res)


def test_main_writes_the_file_from_a_result(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(comm, "launch", lambda a: _result(100e-6, 1.0))
    path = tmp_path / "cluster.json"
    assert comm.main(["--calibrate", str(path), "--formats", "int8", "--json", str(tmp_path / "rows.json")]) == 0
    out = capsys.readouterr().out
    assert "| world | 4 | all_gather | plain | 4K |" in out and "inter: 100.0 us per message step" in out
    assert read_cluster_file(path).links["inter"].gbps == pytest.approx(1.0)
    again = ["--calibrate", str(path), "--formats", "int8", "--json", str(tmp_path / "rows.json")]
    assert comm.main(again) == 0  # its own earlier files are replaced
    foreign = tmp_path / "notes.json"
    foreign.write_text("[1, 2]")
    monkeypatch.setattr(comm, "launch", lambda a: pytest.fail("the sweep ran for a --calibrate it cannot write"))
    with pytest.raises(SystemExit) as e:  # refused before the sweep, not after it
        comm.main(["--calibrate", str(foreign)])
    assert e.value.code == 2 and "is not a file this command can tell it wrote" in capsys.readouterr().err
    assert foreign.read_text() == "[1, 2]"


def test_under_torchrun_the_world_is_torchruns(monkeypatch, capsys) -> None:
    for k, v in {"RANK": "0", "WORLD_SIZE": "8", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.delenv("ZEROPP_LAUNCHED_RANK", raising=False)
    a = comm.parse_args(["--nodes", "1", "--formats", "none"])
    assert (a.spec.nodes, a.spec.ranks_per_node) == (2, 4)
    with pytest.raises(SystemExit) as e:
        comm.parse_args(["--cluster", "emulated"])
    assert e.value.code == 2 and "under torchrun" in capsys.readouterr().err


def test_an_interrupted_benchmark_is_not_reported_as_a_failed_world(monkeypatch) -> None:
    """Ctrl-C reaches the command (experiments/launch/command.py: exit 130), not ``the benchmark
    world failed`` with exit 1."""
    from zeropp.experiments.launch import RunInterrupted

    def stopped(a):
        raise RunInterrupted("interrupted by SIGINT; all ranks stopped", exit_code=130)

    monkeypatch.setattr(comm, "launch", stopped)
    with pytest.raises(RunInterrupted):
        comm.main(["--formats", "none"])


def test_more_local_cpu_ranks_than_the_host_runs_is_a_usage_error(monkeypatch, capsys) -> None:
    """Before: 10000 rank processes were started on this host."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(comm, "host_cpus", lambda: 2)
    with pytest.raises(SystemExit) as e:
        comm.parse_args(["--nodes", "100", "--ranks-per-node", "100", "--formats", "none"])
    err = capsys.readouterr().err
    assert (
        e.value.code == 2 and "= 10000 ranks, all started on this host, which has 2 CPU(s); allowed: at most 8" in err
    )
    assert comm.parse_args(["--nodes", "2", "--ranks-per-node", "4", "--formats", "none"]).spec.world == 8
