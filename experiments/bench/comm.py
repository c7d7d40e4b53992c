"""Collective benchmark (nccl-tests / ds_bench for zeropp): bus bandwidth per collective, group and
wire format, and the calibrated cluster file the cost model reads.

    python -m experiments.bench_comm                                   # 4 ranks as 2 x 2, this host
    sudo python -m experiments.bench_comm --cluster emulated --gbps 1 --calibrate cluster.json
    torchrun --nproc-per-node 8 -m experiments.bench_comm --ranks-per-node 8 --max-bytes 1G

all-gather, reduce-scatter, all-to-all and all-reduce over the world, inside a node (``intra``)
and across nodes (``inter``: one rank per node), plain and through each registered codec (the
library's quantized collectives; ``--formats``), at sizes from ``--min-bytes`` to ``--max-bytes``
(powers of ``--step``), ``--warmup`` untimed and ``--iters`` timed calls each, the median kept
(``comm_rank.py`` has the rank side). Per row the time, the algorithm and nccl-tests' bandwidths
(its PERFORMANCE.md): ``algbw = size / time`` and ``busbw = algbw x factor``, factor ``(n-1)/n``
for all-gather, reduce-scatter and all-to-all and ``2(n-1)/n`` for all-reduce, with ``size`` the
full-precision buffer (so a quantized row's busbw is the rate the caller sees, not the wire's).
A table on stdout; ``--json FILE`` all rows.

Where it runs: this host's ranks through the launcher (``--cluster local``), the emulated cluster
(``--cluster emulated --gbps X``: network namespaces with a shaped uplink per node; root), or, when
already started by torchrun, as that rank (one node per ``LOCAL_WORLD_SIZE`` ranks).

``--calibrate FILE`` fits latency and bandwidth per link class on the plain all-gathers' size sweep
and writes them with the codecs' kernel rates as a cluster file
(``experiments.projection.cluster_file``), which ``python -m experiments.scaling``,
``python -m experiments.step_schedule`` and ``bench_cluster --check`` take as ``--cluster-file``.

Default ``--max-bytes``: 1 GiB on GPUs; 4 MiB on CPU, where gloo copies through the kernel's TCP
loopback at a few Gbit/s per rank, so one 1 GiB call over 4 ranks takes seconds and the full grid
(4 collectives x 3 groups x 9 formats x the sizes) hours.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, NoReturn

from zeropp.output_files import path_text_arg, write_output_file

from ..cluster.emulator import link_problem
from ..launch import ModuleEntry, RankFailure, RunInterrupted, in_torchrun, launch_world
from ..launch.command import run_command
from ..projection.cluster_file import ClusterFile, is_cluster_file, link_fit, write_cluster_file
from ..projection.scaling import canonical_format
from ..runner.launcher import emulated_placement, local_placement
from ..runner.preflight import RANKS_PER_CPU, host_cpus
from .args import check_json_output, json_with_keys
from .comm_rank import GROUPS, OPS, CommBenchSpec, format_specs, rank_main

JSON_SHAPE = json_with_keys("backend", "nodes", "ranks_per_node", "rows")
"""What ``--json`` writes (rank 0's result): an earlier run's file of this shape may be replaced, nothing else."""

GPU_MAX_BYTES = 1 << 30
CPU_MAX_BYTES = 1 << 22
"""Default ``--max-bytes`` with and without GPUs (module doc: why smaller on CPU)."""


def parse_bytes(text: str) -> int:
    """``1024``, ``64K``, ``4M``, ``1G`` (binary units) -> bytes; ValueError otherwise."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        n = int(t[:-1] if mult > 1 else t) * mult
    except ValueError:
        raise ValueError(f"{text!r} is not a size; use e.g. 1024, 64K, 4M, 1G") from None
    if n < 4:
        raise ValueError(f"size {text!r} is below one fp32 element (4 bytes)")
    return n


def _bytes_arg(text: str) -> int:
    """:func:`parse_bytes` for argparse: its message reaches the user (argparse reports a plain
    ValueError of a ``type=`` as ``invalid parse_bytes value``, dropping what to type instead)."""
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def size_sweep(lo: int, hi: int, step: int) -> tuple[int, ...]:
    """``lo, lo * step, ...`` up to ``hi`` (inclusive when reached)."""
    if step not in (2, 4) or lo > hi:
        raise ValueError(f"sizes {lo}..{hi} by x{step}: use --step 2 or 4 and --min-bytes <= --max-bytes")
    out = [lo]
    while out[-1] * step <= hi:
        out.append(out[-1] * step)
    return tuple(out)


def _csv(choices: tuple[str, ...]) -> Any:
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(x for x in text.split(",") if x)
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{text!r}: use a comma-separated subset of {','.join(choices)}")
        twice = sorted({x for x in items if items.count(x) > 1})
        if twice:  # each would be measured again: the same rows twice
            raise argparse.ArgumentTypeError(f"{text!r} names {','.join(twice)} more than once; name each once")
        return items

    return parse


def _check_links_and_time(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """``--gbps`` / ``--latency-ms`` shape the emulated cluster's links only: with ``--cluster
    local`` they would be silently ignored, so they are refused there; rates, latencies and the
    time limit must be finite and in range. Sets their defaults (1 Gbit/s, 0 ms)."""
    given = [f for f, v in (("--gbps", a.gbps), ("--latency-ms", a.latency_ms)) if v is not None]
    if a.cluster == "local" and given:
        p.error(
            f"{' and '.join(given)} shape(s) the links of --cluster emulated; with --cluster local nothing is "
            "shaped: add --cluster emulated (root), or remove them"
        )
    a.gbps = 1.0 if a.gbps is None else a.gbps
    a.latency_ms = 0.0 if a.latency_ms is None else a.latency_ms
    if not (math.isfinite(a.latency_ms) and a.latency_ms >= 0):
        p.error(f"--latency-ms must be a finite number >= 0, got {a.latency_ms:g}")
    if not (math.isfinite(a.timeout) and a.timeout > 0):
        p.error(f"--timeout must be a finite number of seconds > 0, got {a.timeout:g}")


def _check_groups(p: argparse.ArgumentParser, spec: CommBenchSpec) -> None:
    """Each group named in ``--groups`` must measure something at this shape: 2 or more members,
    and (``intra`` / ``inter``) fewer than the world, which ``world`` already measures. Unnamed,
    the groups that measure nothing are passed over; named, such a group was silently skipped."""
    sizes = {"world": spec.world, "intra": spec.ranks_per_node, "inter": spec.nodes}
    for g in spec.groups:
        if sizes[g] < 2 or (g != "world" and sizes[g] == spec.world):
            why = "fewer than 2 ranks" if sizes[g] < 2 else "all the ranks, as world does"
            p.error(
                f"--groups {g}: with --nodes {spec.nodes} x --ranks-per-node {spec.ranks_per_node} the {g} group "
                f"holds {why}; nothing to measure there: change the shape, or leave {g} out"
            )


def _check_local_ranks(p: argparse.ArgumentParser, world: int) -> None:
    """The local launcher starts every rank on this host: on CPU at most the runner's
    ``RANKS_PER_CPU`` per CPU (more only thrash, and thousands exhaust the memory)."""
    import torch

    if torch.cuda.is_available():
        return
    cpus = host_cpus()
    if world > RANKS_PER_CPU * cpus:
        p.error(
            f"--nodes x --ranks-per-node = {world} ranks, all started on this host, which has {cpus} CPU(s); "
            f"allowed: at most {RANKS_PER_CPU * cpus} ({RANKS_PER_CPU} per CPU); run larger worlds under torchrun"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.bench_comm", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--cluster", choices=("local", "emulated"), default="local")
    p.add_argument("--gbps", type=float, default=None, help="cross-node rate of --cluster emulated, Gbit/s (default 1)")
    p.add_argument(
        "--latency-ms", type=float, default=None, help="one-way cross-node latency (emulated; netem; default 0)"
    )
    p.add_argument("--ops", type=_csv(OPS), default=OPS, help=f"comma-separated subset of {','.join(OPS)}")
    p.add_argument(
        "--groups", type=_csv(GROUPS), default=None, help=f"comma-separated subset of {','.join(GROUPS)} (default: all)"
    )
    p.add_argument(
        "--formats",
        default=None,
        help="wire formats beside the plain collective, comma-separated (default: every registered scheme at "
        f"each width: {','.join(format_specs())}); 'none': plain only",
    )
    p.add_argument("--min-bytes", type=_bytes_arg, default=1024)
    p.add_argument("--max-bytes", type=_bytes_arg, default=None, help="default 1G on GPUs, 4M on CPU (see above)")
    p.add_argument("--step", type=int, default=4, help="size multiplier between rows, 2 or 4")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--timeout", type=float, default=1800.0, help="the whole benchmark, seconds")
    p.add_argument("--json", type=path_text_arg, default=None, help="also write every row to this file")
    p.add_argument(
        "--calibrate", type=path_text_arg, default=None, metavar="FILE", help="write a cluster file fitted on the sweep"
    )
    p.add_argument("--rank-main", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.rank_main:
        return a
    _check_links_and_time(p, a)
    if a.max_bytes is None:
        import torch

        a.max_bytes = GPU_MAX_BYTES if torch.cuda.is_available() else CPU_MAX_BYTES
    if in_torchrun():  # the world's shape is torchrun's
        if a.cluster == "emulated":
            p.error("--cluster emulated starts its own ranks; under torchrun the world is torchrun's (drop --cluster)")
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        a.ranks_per_node, a.nodes = local, int(os.environ["WORLD_SIZE"]) // local
    try:
        named = None if a.formats in (None, "none") else [canonical_format(f) for f in a.formats.split(",")]
        if named is not None and len(set(named)) < len(named):
            raise ValueError(
                f"--formats {a.formats} names a format more than once (mx4 / mx6 / mx8 are earlier spellings of "
                "mxfp4 / mxfp6 / mxfp8); name each once"
            )
        formats = () if a.formats == "none" else tuple(format_specs(None if named is None else tuple(named)))
        a.spec = CommBenchSpec(
            nodes=a.nodes,
            ranks_per_node=a.ranks_per_node,
            ops=a.ops,
            groups=a.groups or GROUPS,
            formats=formats,
            sizes=size_sweep(a.min_bytes, a.max_bytes, a.step),
            warmup=a.warmup,
            iters=a.iters,
        )
    except ValueError as e:
        p.error(str(e))
    if a.spec.world < 2:
        p.error("a collective benchmark needs >= 2 ranks (--nodes x --ranks-per-node)")
    if a.groups is not None:
        _check_groups(p, a.spec)
    if not in_torchrun():
        _check_local_ranks(p, a.spec.world)
    if a.min_bytes < 4 * a.spec.world:  # each rank holds whole fp32 elements: smaller sizes round up alike
        p.error(
            f"--min-bytes {a.min_bytes} is less than one fp32 element per rank of the {a.spec.world}-rank world "
            f"({4 * a.spec.world} bytes): every size below that would be measured at {4 * a.spec.world} bytes, the "
            f"same row again; use --min-bytes >= {4 * a.spec.world}"
        )
    if a.cluster == "emulated" and not (math.isfinite(a.gbps) and a.gbps > 0 and a.nodes >= 2):
        p.error(f"--cluster emulated needs --nodes >= 2 and a finite --gbps > 0, got {a.nodes} and {a.gbps}")
    if a.cluster == "emulated" and (
        why := link_problem(a.gbps, a.latency_ms, gbps_key="--gbps", latency_key="--latency-ms")
    ):
        p.error(why)  # a rate tc cannot shape (a unit slip): refused here, not by tc once the world is up
    if a.calibrate and "all_gather" not in a.ops:
        p.error("--calibrate fits the plain all-gathers: keep all_gather in --ops")
    check_json_output(p, a.json, "--json", JSON_SHAPE)
    check_json_output(p, a.calibrate, "--calibrate", is_cluster_file)
    return a


def launch(a: argparse.Namespace) -> dict[str, Any] | None:
    """Run the benchmark world (module doc) and return rank 0's results (None on the other ranks
    of a torchrun world)."""
    spec: CommBenchSpec = a.spec
    if in_torchrun():
        return rank_main(spec)
    with tempfile.TemporaryDirectory(prefix="bench_comm-") as tmp:
        out = Path(tmp) / "result.json"
        spec = dataclasses.replace(spec, out=str(out))
        (Path(tmp) / "spec.json").write_text(json.dumps(dataclasses.asdict(spec)))
        placement: contextlib.AbstractContextManager = (
            emulated_placement(spec.world, spec.ranks_per_node, a.gbps, a.latency_ms)
            if a.cluster == "emulated"
            else local_placement(spec.world)
        )
        with placement as pl:
            launch_world(
                ModuleEntry(module=f"{__package__}.comm", args=("--rank-main", str(Path(tmp) / "spec.json"))),
                spec.world,
                placement=pl,
                log_dir=Path(tmp) / "ranks",
                timeout_s=a.timeout,
                ranks_per_node=spec.ranks_per_node,
            )
        return json.loads(out.read_text())


def _size(n: float) -> str:
    for unit, k in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k:.0f}{unit}"
    return f"{n:.0f}"


def format_rows(result: dict[str, Any]) -> str:
    """The benchmark's table, one line per row (markdown)."""
    out = [
        f"{result['nodes']} nodes x {result['ranks_per_node']} ranks, {result['backend']}; time = median of the "
        "slowest rank's; algbw = size / time, busbw = algbw x (n-1)/n (all-reduce 2(n-1)/n), size = fp32 buffer",
        "",
        "| group | ranks | collective | format | size | time us | algorithm | algbw GB/s | busbw GB/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        out.append(
            f"| {r['group']} | {r['ranks']} | {r['op']} | {r['format']} | {_size(r['bytes'])} | {1e6 * r['seconds']:.1f} "
            f"| {r['algorithm']} | {r['algbw_gbs']:.4g} | {r['busbw_gbs']:.4g} |"
        )
    return "\n".join(out)


def calibrate(result: dict[str, Any], source: dict[str, Any] | None = None) -> ClusterFile:
    """The cluster file of a benchmark result: per link class a latency-bandwidth fit of the plain
    all-gathers (``cluster_file`` module doc; ``intra`` on the node's group, else the world of one
    node; ``inter`` on the world when it spans nodes), and the codecs' kernel rates."""
    nodes, rpn = result["nodes"], result["ranks_per_node"]
    classes = {"intra": "intra" if nodes > 1 else "world", "inter": "world"}
    links = {}
    for link, group in classes.items():
        if (link == "inter" and nodes < 2) or (link == "intra" and rpn < 2):
            continue
        rows = [r for r in result["rows"] if r["group"] == group and r["op"] == "all_gather" and r["format"] == "plain"]
        if not rows:
            raise ValueError(
                f"no plain all-gather over the {group!r} group to fit the {link} link on; keep it in --groups"
            )
        n = rows[0]["ranks"]
        try:
            links[link] = link_fit(n, [r["bytes"] * (n - 1) / n for r in rows], [r["seconds"] for r in rows])
        except ValueError as e:
            raise ValueError(f"{link} link: {e}") from None
    rates = tuple((q["op"], q["format"], q["gbs"]) for q in result["quant_rates"])
    return ClusterFile(
        nodes=nodes, ranks_per_node=rpn, backend=result["backend"], links=links, quant_rates=rates, source=source or {}
    )


def format_calibration(cf: ClusterFile) -> str:
    lines = [
        f"{k}: {1e6 * v.alpha_s:.1f} us per message step, {v.gbps:.3f} Gbit/s bus bandwidth "
        f"(fit on {v.points} sizes, {v.ranks} ranks)"
        for k, v in cf.links.items()
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.rank_main:
        rank_main(CommBenchSpec.from_json(json.loads(Path(a.rank_main).read_text())))
        return 0
    try:
        result = launch(a)
        if result is None:  # a torchrun rank other than 0: rank 0 reports
            return 0
    except RunInterrupted:  # the benchmark was stopped (Ctrl-C, SIGTERM): 128 + N, not a failed world
        raise
    except RankFailure as e:
        print(f"error: the benchmark world failed: {e}", file=sys.stderr)
        return e.exit_code if e.exit_code == 2 else 1
    print(format_rows(result))
    if a.json:
        write_output_file(Path(a.json), json.dumps(result, indent=1))
    if a.calibrate:
        source: dict[str, Any] = {
            "command": " ".join(["python -m experiments.bench_comm", *(argv if argv is not None else sys.argv[1:])]),
            "cluster": a.cluster,
            "gbps": a.gbps if a.cluster == "emulated" else None,
        }
        try:
            cf = calibrate(result, source)
            write_cluster_file(a.calibrate, cf)
        except (ValueError, OSError) as e:
            print(f"error: --calibrate {a.calibrate}: {e}", file=sys.stderr)
            return 2
        print(f"\ncluster file {a.calibrate}:\n{format_calibration(cf)}")
    return 0


def cli() -> NoReturn:
    """The command: :func:`main`, ended by ``launch.command.run_command`` (Ctrl-C or a failed world
    is one ``error:`` line and the shell's exit status, never a traceback). A rank of the
    benchmark's own world (``--rank-main``) or of torchrun's runs :func:`main` bare: its launcher
    reports the interrupt once, and its SIGTERM keeps the launcher's meaning (the rank ends now)."""
    if "--rank-main" in sys.argv[1:] or in_torchrun():
        sys.exit(main())
    run_command(main)


if __name__ == "__main__":
    cli()
