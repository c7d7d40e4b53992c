"""``python -m experiments.scaling``: the ZeRO++ paper's speedup table (ZeRO-3 against ZeRO++ on the
paper's 18B GPT across cluster sizes and link rates), printed and plotted.

:func:`paper_workload` is the paper's regime, :func:`speedup_table` the rows (any projector:
``scaling.project`` serial, ``step_schedule.project_scheduled`` scheduled),
:func:`format_table` / :func:`plot` their two views and :func:`main` the command (also
``python -m experiments.step_schedule``'s, with the scheduled projector).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Iterable, NoReturn

from zeropp.comm.spec import RECIPES
from zeropp.output_files import OutputFileError, check_output_file, holds_tag, write_output_file

from ..launch.command import run_command
from .cluster_file import ClusterFile, ClusterFileError, merge_rates, read_cluster_file
from .flags import compute_rate, fraction, link_rate, positive_count
from .scaling import Projection, gpt_units, project
from .spec import Cluster, Workload
from .text_table import Column, number, text_table


def paper_workload(*, tokens_per_gpu: int = 1024, achieved_tflops: float = 50.0) -> Workload:
    """The ZeRO++ paper's regime: an 18B GPT (d 6144, 40 layers) in fp16 on V100s, a small batch
    per GPU (where ZeRO-3 is communication bound), compute at ``achieved_tflops`` per GPU with
    activation recomputation (8 flops per parameter per token)."""
    units = gpt_units(vocab=50304, seq_len=2048, d_model=6144, n_layers=40, tie_embeddings=False)
    n = sum(units)
    return Workload(
        units=units,
        compute_s=8 * n * tokens_per_gpu / (achieved_tflops * 1e12),
        tokens_per_rank=tokens_per_gpu,
        stage=3,
        flops_per_token=6.0 * n,
    )


ZEROPP: dict[str, Any] = {
    "weights": RECIPES["zeropp"].weights,
    "grads": RECIPES["zeropp"].grads,
    "hpz": RECIPES["zeropp"].hpz,
}
"""The full ZeRO++ switches (the ``zeropp`` recipe: qwZ INT8, hpZ, qgZ INT4), for :meth:`Workload.with_zero`."""


def speedup_table(
    w: Workload,
    *,
    gbps: Iterable[float] = (100.0, 400.0),
    ranks_per_node: int = 8,
    max_ranks: int = 384,
    nics_per_node: int | None = None,
    projector: Callable[[Workload, Cluster], Projection] | None = None,
    cluster_file: ClusterFile | None = None,
) -> list[dict[str, float]]:
    """ZeRO-3 vs ZeRO++ for 1..max_ranks/ranks_per_node nodes at each bandwidth, projected by
    ``projector`` (default :func:`project`; ``step_schedule.project_scheduled`` for overlap).
    ``cluster_file``: its link figures replace the clusters' latency and intra-node constants
    (and its inter-node bandwidth every rate of ``gbps``), its ``(op, format)`` rates the
    workload's quantization rates."""
    projector = projector or project
    if cluster_file is not None:
        if "inter" in cluster_file.links:
            gbps = (cluster_file.links["inter"].gbps,)
        w = dataclasses.replace(w, quant_rates=merge_rates(w.quant_rates, cluster_file))
    rows = []
    base = w.with_zero(weights=None, hpz=False, grads=None)
    plus = w.with_zero(**ZEROPP)
    node_counts = sorted(
        {n for n in (1, 2, 4, 8, 16, 24, 32, 48) if n * ranks_per_node <= max_ranks} | {max_ranks // ranks_per_node}
    )
    for bw in gbps:
        for n in node_counts:
            c = Cluster(nodes=n, ranks_per_node=ranks_per_node, cross_gbps=bw, nics_per_node=nics_per_node)
            c = cluster_file.cluster(c) if cluster_file is not None else c
            p0, p1 = projector(base, c), projector(plus, c)
            rows.append(
                {
                    "gbps": bw,
                    "nodes": n,
                    "gpus": c.world,
                    "zero3_step_s": p0.step_s,
                    "zeropp_step_s": p1.step_s,
                    "zero3_tflops": p0.tflops_per_rank,
                    "zeropp_tflops": p1.tflops_per_rank,
                    "speedup": p0.step_s / p1.step_s,
                    "zero3_cross_gb": p0.node_cross_bytes / 1e9,
                    "zeropp_cross_gb": p1.node_cross_bytes / 1e9,
                }
            )
    return rows


PROJECTION_COLUMNS = (
    Column(title="NIC Gbps", width=8, cell=number("gbps", ".4g")),  # 0.0001 reads so, not 0
    Column(title="GPUs", width=5, cell=number("gpus", "d")),
    Column(title="ZeRO-3 s", width=9, cell=number("zero3_step_s", ".2f")),
    Column(title="ZeRO++ s", width=9, cell=number("zeropp_step_s", ".2f")),
    Column(title="ZeRO-3 TF", width=9, cell=number("zero3_tflops", ".1f")),
    Column(title="ZeRO++ TF", width=9, cell=number("zeropp_tflops", ".1f")),
    Column(
        title="x-node GB/node (3 -> ++)",
        width=25,
        cell=lambda r: f"{r['zero3_cross_gb']:.1f} -> {r['zeropp_cross_gb']:>8.1f}",
    ),
    Column(title="speedup", width=8, cell=number("speedup", ".2f", suffix="x")),
)
"""The columns of :func:`format_table` (the rows of :func:`speedup_table`)."""


def format_table(rows: list[dict[str, float]]) -> str:
    return text_table(PROJECTION_COLUMNS, rows)


PLOT_TAG = "zeropp experiments.scaling"
"""Written into every plot's metadata (PNG ``Software``, PDF / SVG ``Creator``): how a later run
tells its own earlier plot, which it may replace, from a file of the user's, which it refuses."""
PLOT_SUFFIXES = {".png": "Software", ".pdf": "Creator", ".svg": "Creator"}
"""The file types ``--plot`` writes, each with the metadata key that carries :data:`PLOT_TAG`."""


def is_our_plot(path: Path) -> bool:
    """Whether ``path`` is a plot this command wrote (:data:`PLOT_TAG` in its metadata field)."""
    return holds_tag(path, PLOT_TAG)


def check_plot_path(path: Path) -> None:
    """Refuse (:class:`zeropp.output_files.OutputFileError`) before the projection a ``--plot`` that
    cannot be written or would replace a file this command did not write, or whose ending is not a
    type it draws (a path without one was silently written as ``<path>.png``, beside it)."""
    if path.suffix.lower() not in PLOT_SUFFIXES and not path.is_dir():
        raise OutputFileError(
            f"--plot {path}: name a {', '.join(PLOT_SUFFIXES)} file (the ending picks the type), or '' to skip the plot"
        )
    check_output_file(path, "--plot", ours=is_our_plot, create_parents=True, suffix_hint=".png")


def plot(rows: list[dict[str, float]], path: str) -> None:
    """Draw the throughput and speedup of ``rows`` into ``path`` (:data:`PLOT_SUFFIXES`), atomically."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, bw in enumerate(sorted({r["gbps"] for r in rows})):
        rs = [r for r in rows if r["gbps"] == bw]
        g = [r["gpus"] for r in rs]
        color = f"C{i}"
        ax1.plot(g, [r["zero3_tflops"] for r in rs], "o--", color=color, label=f"ZeRO-3 {bw:g} Gbps/NIC")
        ax1.plot(g, [r["zeropp_tflops"] for r in rs], "s-", color=color, label=f"ZeRO++ {bw:g} Gbps/NIC")
        ax2.plot(g, [r["speedup"] for r in rs], "o-", color=color, label=f"{bw:.0f} Gbps/NIC")
    ax1.set(xlabel="GPUs", ylabel="TFLOP/s per GPU", title="Projected throughput", xscale="log")
    ax2.set(xlabel="GPUs", ylabel="ZeRO++ / ZeRO-3", title="Projected speedup", xscale="log")
    ax2.axhline(1.0, color="grey", lw=0.5)
    for ax in (ax1, ax2):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    kind = Path(path).suffix.lower()
    buf = io.BytesIO()
    fig.savefig(buf, format=kind[1:], dpi=120, metadata={PLOT_SUFFIXES[kind]: PLOT_TAG})
    plt.close(fig)
    write_output_file(Path(path), buf.getvalue())


def main(
    argv: list[str] | None = None,
    *,
    projector: Callable[[Workload, Cluster], Projection] | None = None,
    prog: str = "python -m experiments.scaling",
) -> None:
    """The projection table and plot; ``projector`` as in :func:`speedup_table` (the scheduled
    model's CLI, ``python -m experiments.step_schedule``, passes its own)."""
    import argparse

    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--gbps", type=link_rate, nargs="+", default=None, help="Gbit/s of one cross-node NIC (default 100 400)"
    )
    ap.add_argument("--ranks-per-node", type=positive_count, default=8)
    ap.add_argument(
        "--nics-per-node",
        type=positive_count,
        default=None,
        help="cross-node NICs per node, each shared by ranks-per-node/nics ranks (default: one per GPU)",
    )
    ap.add_argument("--max-gpus", type=positive_count, default=384)
    ap.add_argument("--tokens-per-gpu", type=positive_count, default=1024)
    ap.add_argument("--tflops", type=compute_rate, default=50.0, help="achieved compute TFLOP/s per GPU")
    ap.add_argument("--overlap", type=fraction, default=0.0, help="fraction of comm hidden under compute")
    ap.add_argument(
        "--plot",
        default="outputs/scaling.png" if projector is None else "outputs/scaling_scheduled.png",
        help="where to save the plot ('' to skip)",
    )
    ap.add_argument(
        "--cluster-file",
        default=None,
        help="a calibrated cluster file (python -m experiments.bench_comm --calibrate FILE): its latencies, "
        "bandwidths and quantization rates replace the hand-set constants (its inter-node rate replaces --gbps)",
    )
    a = ap.parse_args(argv)
    given_gbps, a.gbps = a.gbps is not None, a.gbps or [100.0, 400.0]
    if len(set(a.gbps)) != len(a.gbps):
        ap.error(
            f"--gbps {' '.join(f'{g:g}' for g in a.gbps)} repeats a rate (its rows would print twice); give each once"
        )
    if a.nics_per_node is not None and a.ranks_per_node % a.nics_per_node:
        ap.error(f"--nics-per-node {a.nics_per_node} must divide --ranks-per-node {a.ranks_per_node}")
    if a.max_gpus < a.ranks_per_node:
        ap.error(f"--max-gpus {a.max_gpus} is less than one node (--ranks-per-node {a.ranks_per_node})")
    if a.plot:
        try:
            check_plot_path(Path(a.plot))
        except OutputFileError as e:
            ap.error(str(e))
    try:
        cf = read_cluster_file(a.cluster_file) if a.cluster_file else None
    except ClusterFileError as e:
        ap.exit(2, f"error: {e}\n")
    if given_gbps and cf is not None and "inter" in cf.links:  # the file's rate wins: the flag would do nothing
        ap.error(
            f"--gbps {' '.join(f'{g:g}' for g in a.gbps)} does nothing with --cluster-file {a.cluster_file}, whose "
            f"inter-node rate ({cf.links['inter'].gbps:.4g} Gbit/s) replaces it: remove --gbps, or the file"
        )
    if projector is not None and a.overlap:
        ap.error(
            "--overlap is the serial model's fraction; the scheduled model takes its overlap from the engine's "
            "issue order (leave --overlap out, or use python -m experiments.scaling)"
        )
    w = dataclasses.replace(
        paper_workload(tokens_per_gpu=a.tokens_per_gpu, achieved_tflops=a.tflops), overlap=a.overlap
    )
    nics = a.nics_per_node or a.ranks_per_node
    print(
        f"ZeRO-3 vs ZeRO++ (qwZ INT8 + hpZ + qgZ INT4): {sum(w.units) / 1e9:.1f}B-parameter GPT, fp16, "
        f"{a.tokens_per_gpu} tokens/GPU/step, {a.tflops:g} TFLOP/s compute, {a.ranks_per_node} GPUs/node, "
        f"{nics} NIC(s)/node of the given Gbps, each shared by {a.ranks_per_node // nics} GPU(s); "
        + (
            f"quantization at {w.quant_gbs:g} GB/s; "
            if cf is None
            else f"links and quantization rates from {a.cluster_file}; "
        )
        + (
            "serial step (compute + communication)"
            if projector is None
            else "scheduled step (overlap as the engine issues)"
        )
    )
    rows = speedup_table(
        w,
        gbps=a.gbps,
        ranks_per_node=a.ranks_per_node,
        max_ranks=a.max_gpus,
        nics_per_node=a.nics_per_node,
        projector=projector,
        cluster_file=cf,
    )
    print(format_table(rows))
    if a.plot:
        plot(rows, a.plot)
        print(f"plot: {a.plot}")


def cli() -> NoReturn:
    """The command: :func:`main`, ended by ``launch.command.run_command`` (Ctrl-C or a failed world
    is one ``error:`` line and the shell's exit status, never a traceback)."""
    run_command(main)


if __name__ == "__main__":
    cli()
