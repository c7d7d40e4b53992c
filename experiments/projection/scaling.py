"""Scaling projection: a latency-bandwidth cost model of ZeRO / ZeRO++ step time on big clusters.

Why: we can measure 4 CPU ranks, not 384 GPUs. The model takes what does not change with the
cluster (the model's communication units, the compute time per step per rank, measured or from
FLOPs) and what does (nodes x ranks per node, intra- and cross-node bandwidth and latency), and
predicts step time and throughput for ZeRO-3 and ZeRO++.

Messages (:func:`messages`; exactly what the engine sends and CommStats records, checked per kind
and link against real engine steps for every quantization preset in tests/{unit,distributed}/test_scaling_bytes.py):
units (the root and each transformer block) padded to the world size like the engine's flat
units, cut into bucket chunks (``allgather_bucket`` / ``reduce_bucket``) that are quantized
separately, with wire sizes from the spec's own codec (``zeropp.comm.codecs``):

* stage 3: forward all-gather over the world (qwZ: quantized shards); backward all-gather over
  the world, or (hpZ) of the full-precision secondary partition (``padded / hpz_size``) inside
  the hpZ group -- as are the forwards of micro-batches 2.. of a step, since the secondary
  built in the first forward lives until the optimizer step; gradient reduce-scatter over the
  world, or (qgZ, recorded under the same kind) an intra-node all-to-all of the quantized
  gradient followed by a cross-node all-to-all of each rank's requantized 1/ranks_per_node slice.
* stages 1-2: gradient reduce-scatter (qgZ as above) and a parameter all-gather after the step;
  stage 0: an all-reduce of each whole unit (``2 * bytes // world`` to each peer).
* control: the loss / norm all-reduce and the after-forward check (no rank failed; stage 3: the
  same blocks ran), a few bytes that CommStats deliberately leaves out (:func:`control_messages`,
  latency only).

Time of one collective over a group spanning ``n`` nodes x ``r`` ranks: ``(g-1)*alpha`` plus the
link time. Cross-node: :func:`uplink_call_bytes` over ``cross_gbps``. With ``Cluster.wire=
"pairwise"`` every rank sends its *pairwise* bytes to each cross-node peer (all-gather: its shard
to each; reduce-scatter: each peer's chunk; all-reduce: twice that; qgZ's cross all-to-all: one
row per other node), and the ``ranks_per_uplink`` ranks that share one uplink (NIC) send at once,
so the uplink carries ``ranks_per_uplink x`` one rank's cross bytes. ``wire="ring"`` is gloo's
schedule (the emulator): an all-gather runs as a ring in rank order, so one edge leaves each node
carrying ``g - 1`` chunks, a reduce-scatter as a ring all-reduce (``2 (g - 1)``); all-to-alls are
pairwise. (The pairwise count on gloo is what overstated ZeRO++'s uplink bytes by 20-24%: its
all-gathers cross a 2x2 emulator's uplink 3 times per shard, not 4.) ``Cluster.nics_per_node``
sets the sharing: by default one NIC per rank (8-GPU nodes with 8 NICs; the plain collectives
then take exactly a bandwidth-optimal ring's time over a node whose aggregate rate is
``cross_gbps``), ``nics_per_node=1`` for the emulator (one shared uplink). Intra-node: ``(g-1)``
chunks per rank at ``B_intra``, beside the cross-node time on GPUs (max) or added on CPU ranks.
Quantize/dequantize kernels (:func:`quant_work`) are charged at measured rates
(``Workload.quant_rates``, see ``calibration.measure_quant_rates``) or ``quant_gbs``.
Step time = compute + comm + quantization - overlap * min(compute, comm). That serial formula
is what :func:`project` and the cluster tables use; ``experiments/projection/step_schedule.py`` replays the
engine's issue order on a compute and a link resource instead (prefetched gathers and in-flight
reduce-scatters overlapping compute), from the same messages, and is what ``bench_cluster
--check`` judges.

Three byte views come out of the same messages: ``pairwise_bytes`` (what this rank hands to each
peer, by kind and link: zeropp.comm.CommStats' accounting, exactly), ``uplink_bytes`` (what one
uplink carries under ``Cluster.wire``: with ``"pairwise"`` the node's ranks' accounted cross-node
bytes, with ``"ring"`` gloo's wire, what the emulator's tx counter reads) and ``node_cross_bytes``
(what a bandwidth-optimal schedule must bring into a node: the paper's 3M vs 0.75M).

The ZeRO settings are the library's own: ``Workload.weights`` / ``Workload.grads`` are the
``zeropp.comm.spec.QuantSpec`` values of ``ZeroConfig`` (:meth:`Workload.from_zero` turns a run's
ZeroConfig into a workload), so a spec means the same bytes here as on the wire.

The inputs (``Cluster``, ``Workload``, ``Message``) are in ``spec.py``.
``python -m experiments.scaling`` (``speedup.py``) prints the projection for 8 GPUs/node at 100
and 400 Gbps up to 384 GPUs and saves ``outputs/scaling.png``. Checking the model against measured runs is
``scaling_check.py`` (``python -m experiments.scaling_check DIR [--calibrate]``), which imports
this module, never the other way round.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from zeropp.comm.spec import QuantSpec
from zeropp.runtime.choices import Precision
from zeropp.runtime.plan import CONTROL_BYTES, CommPlan, build_plan
from zeropp.runtime.plan_kinds import CommKind, chunk_ranges

from .spec import GBPS, Cluster, Message, Workload


def chunk_widths(cols: int, rows: int, bucket: int) -> dict[int, int]:
    """``{columns: calls}`` of a ``[rows, cols]`` collective cut into buckets of at most ``bucket``
    elements: the engine's rule, ``zeropp.runtime.plan_kinds.chunk_ranges``, counted by width."""
    out: dict[int, int] = {}
    for a, b in chunk_ranges(cols, rows, bucket):
        out[b - a] = out.get(b - a, 0) + 1
    return out


def plan_for(w: Workload, c: Cluster) -> CommPlan:
    """The communication plan (``zeropp.runtime.plan``) of one step of ``w`` on ``c``: the ZeroConfig
    and Topology the workload describes (``dtype_bytes`` 2 plans bf16 on the wire, 4 fp32)."""
    from zeropp.comm.topology import Topology
    from zeropp.runtime import ZeroConfig

    zero = ZeroConfig(
        stage=w.stage,
        weights=w.weights,
        grads=w.grads,
        hpz=w.hpz,
        hpz_size=w.hpz_size if w.hpz else None,
        weight_diff=w.weight_diff,
        precision=Precision.fp32 if w.dtype_bytes == 4 else Precision.bf16,
        grad_accum_steps=w.grad_accum,
        allgather_bucket_size=w.allgather_bucket,
        reduce_bucket_size=w.reduce_bucket,
        coalesce_numel=w.coalesce,
        keep_at_turn=w.keep_at_turn,
    )
    return build_plan(w.units, zero, Topology(nodes=c.nodes, ranks_per_node=c.ranks_per_node))


def plan_messages(plan: CommPlan) -> list[Message]:
    """The counted collectives of ``plan`` as :class:`Message` s, identical calls (same kind,
    algorithm, group shape, bytes, unit and phase) merged into one with their ``count``, in the
    order of their first call."""
    merged: dict[tuple, int] = {}
    for m in plan.collectives:
        if m.counted:
            key = (m.kind, m.algo, m.nodes, m.ranks, m.peer_bytes, m.unit, m.phase)
            merged[key] = merged.get(key, 0) + 1
    return [
        Message(kind, algo, nodes, ranks, b, count, unit, phase)
        for (kind, algo, nodes, ranks, b, unit, phase), count in merged.items()
    ]


def messages(w: Workload, c: Cluster) -> list[Message]:
    """Every collective of one step, with exact per-peer chunk sizes, as the engine issues them:
    the counted collectives of :func:`plan_for` (``zeropp.runtime.plan`` says what they are), merged
    by :func:`plan_messages`. The loss / norm all-reduce and the per-micro-batch after-forward
    check are control messages that CommStats does not count; :func:`control_messages` gives them
    for the time model."""
    return plan_messages(plan_for(w, c))


def control_messages(w: Workload, c: Cluster) -> int:
    """Small uncounted all-reduces per step: the loss and squared-norm sum, and the per-forward
    check that no rank's forward failed (stage 3: and that every rank ran the same blocks), one
    per micro-batch. They cost latency only."""
    return sum(1 for m in plan_for(w, c).collectives if m.kind == CommKind.CONTROL)


def control_time(w: Workload, c: Cluster) -> float:
    """Seconds of the :func:`control_messages` (latency-bound all-reduces of a few scalars)."""
    scalars = Message(CommKind.CONTROL, "all_reduce", c.nodes, c.ranks_per_node, CONTROL_BYTES, 1)
    return control_messages(w, c) * collective_time(scalars, c)


def pairwise_bytes(msgs: Iterable[Message]) -> dict[str, float]:
    """Bytes this rank sends per step, ``{"<kind>.<intra|cross>": bytes}`` (CommStats' accounting)."""
    out: dict[str, float] = {}
    for m in msgs:
        if m.algo == "a2a_cross":
            intra_peers, cross_peers = 0, m.nodes - 1
        else:
            intra_peers, cross_peers = m.ranks - 1, (m.nodes - 1) * m.ranks
        for link, peers in (("intra", intra_peers), ("cross", cross_peers)):
            if peers:
                key = f"{m.kind}.{link}"
                out[key] = out.get(key, 0) + peers * m.chunk_bytes * m.count
    return out


def node_cross_bytes(msgs: Iterable[Message], c: Cluster) -> float:
    """Bytes that must enter one node from other nodes per step with a bandwidth-optimal schedule
    (hierarchical ring: each byte enters a node once, (n-1)/n of the buffer per collective): the
    paper's 3M vs 0.75M. Flat pairwise sends (gloo, or one NIC per rank) move
    :func:`uplink_bytes` per uplink instead."""
    total = 0.0
    for m in msgs:
        if m.nodes <= 1:
            continue
        if m.algo == "a2a_cross":
            total += c.ranks_per_node * (m.nodes - 1) * m.chunk_bytes * m.count
        else:  # an all-reduce's chunk_bytes already holds both halves
            total += (m.nodes - 1) / m.nodes * m.chunk_bytes * m.nodes * m.ranks * m.count
    return total


def uplink_call_bytes(m: Message, c: Cluster) -> int:
    """Bytes the busiest uplink of a node sends for one call of ``m`` under ``c.wire``:

    * all-to-alls, and every collective under ``"pairwise"``: the ``ranks_per_uplink`` ranks that
      share the uplink each send their chunk to every cross-node peer;
    * ``"ring"`` (gloo): the ring in rank order leaves each node over one edge, which carries
      ``g - 1`` chunks of an all-gather and ``2 (g - 1)`` chunks of a reduce-scatter (a ring
      all-reduce) or all-reduce (whose ``chunk_bytes`` already hold both halves)."""
    if m.nodes <= 1:
        return 0
    g = m.nodes * m.ranks
    if m.algo == "a2a_cross":
        return c.ranks_per_uplink * (m.nodes - 1) * m.chunk_bytes
    if m.algo == "a2a_intra":
        return 0
    if c.wire == "ring":
        return (2 if m.algo == "ring_rs" else 1) * (g - 1) * m.chunk_bytes
    return c.ranks_per_uplink * (m.nodes - 1) * m.ranks * m.chunk_bytes


def uplink_bytes(msgs: Iterable[Message], c: Cluster) -> float:
    """Bytes one node uplink sends per step (:func:`uplink_call_bytes` summed; what the emulator's
    uplink counter measures and what the time model charges). Under ``wire="pairwise"`` this is
    the per-rank pairwise cross-node bytes (CommStats' accounting) times the ranks sharing it."""
    return float(sum(uplink_call_bytes(m, c) * m.count for m in msgs))


def link_terms(m: Message, c: Cluster) -> tuple[int, float, float]:
    """(latency steps, cross-node seconds, intra-node bytes per rank) of one call: the three
    terms :func:`collective_time` combines (and ``scaling_check.calibrate`` fits constants to).

    Cross-node seconds: :func:`uplink_call_bytes` over the uplink rate (the ranks sharing an
    uplink send at once)."""
    g = m.nodes * m.ranks
    if g <= 1:
        return 0, 0.0, 0.0
    t_cross = uplink_call_bytes(m, c) / (c.cross_gbps * GBPS)
    if m.algo == "a2a_cross":
        return g - 1, t_cross, 0.0
    if m.algo == "a2a_intra":
        return g - 1, 0.0, (g - 1) * m.chunk_bytes
    k = 2 if m.algo == "all_reduce" or (m.algo == "ring_rs" and c.wire == "ring") else 1
    return k * (g - 1), t_cross, (2 if m.algo == "ring_rs" and c.wire == "ring" else 1) * (g - 1) * m.chunk_bytes


def collective_time(m: Message, c: Cluster) -> float:
    """Alpha-beta time of one call (see module doc)."""
    steps, t_cross, intra = link_terms(m, c)
    alpha = c.alpha_cross_s if m.nodes > 1 else c.alpha_intra_s
    t_intra = intra / (c.intra_gbps * GBPS)
    return steps * alpha + (max(t_cross, t_intra) if c.parallel_links else t_cross + t_intra)


QUANT_OPS = ("quantize", "dequantize", "dequantize_sum_requantize", "dequantize_sum")
"""The ``zeropp.kernels`` ops a ZeRO++ step runs (qwZ: quantize + dequantize; qgZ: quantize,
fused dequantize-sum-requantize, dequantize-sum)."""


FORMAT_ALIASES: dict[str, str] = {"mx4": "mxfp4", "mx6": "mxfp6", "mx8": "mxfp8"}
"""Earlier spellings of the MX float formats -> their names (:func:`format_name`, the names of
``zeropp.comm.spec.RECIPES``). Accepted wherever a format name is read (``bench_comm --formats``,
a cluster file calibrated with them), never printed."""


def format_name(spec: QuantSpec, bits: int) -> str:
    """The wire format of ``spec`` at ``bits`` (one hop's width), as quantization rates are keyed
    and benchmark tables print it: ``int8``, ``int4``, ``mxfp4``, ``mxint8``, the names of the spec's
    recipes (``quant=mxfp4``); a scheme whose name carries its width (``fp8``, ``nvfp4``) is its
    name. The bits alone cannot tell MXFP4 from INT4; this can."""
    if spec.scheme[-1:].isdigit():
        return spec.scheme
    if spec.scheme == "mx":  # the MX float elements: MXFP8 / MXFP6 / MXFP4, as the OCP spec names them
        return f"mxfp{bits}"
    return f"{spec.scheme}{bits}"


def canonical_format(name: str) -> str:
    """``name`` as :func:`format_name` spells it: an earlier spelling (:data:`FORMAT_ALIASES`) mapped,
    any other name unchanged (an unknown one is for the caller to refuse)."""
    return FORMAT_ALIASES.get(name, name)


def known_formats() -> frozenset[str]:
    """Every wire format name :func:`format_name` gives for the registered schemes at their widths:
    the format keys a calibrated cluster file may hold."""
    from zeropp.comm.spec import schemes

    return frozenset(format_name(QuantSpec(scheme=k, bits=b), b) for k, widths in schemes().items() for b in widths)


def quant_work_formats(w: Workload, c: Cluster) -> dict[tuple[str, int, str], int]:
    """:func:`quant_work` keyed by ``(op, bits, format)`` (:func:`format_name`), so a rate timed
    for one format is charged to that format only."""
    w = w.coalesced()  # (each unit is padded as one: a coalesced span's shard is one shard)
    W, R, N = c.world, c.ranks_per_node, c.nodes
    S = sum(-(-u // W) for u in w.units)  # elements of my shards
    out: dict[tuple[str, int, str], int] = {}

    def add(op: str, spec: QuantSpec, bits: int, n: int) -> None:
        key = (op, bits, format_name(spec, bits))
        out[key] = out.get(key, 0) + n

    if w.stage == 3 and w.weights and not w.weight_diff:
        kept = sum(-(-w.units[i] // W) for i in w.kept_at_turn())  # no backward gather (keep_at_turn)
        n = S if w.hpz else 2 * w.grad_accum * S - w.grad_accum * kept
        add("quantize", w.weights, w.weights.bits, n)
        add("dequantize", w.weights, w.weights.bits, W * n)
    if w.weight_diff:  # qWD: quantize my shard's difference, dequantize the world's
        add("quantize", w.weight_diff, w.weight_diff.bits, S)
        add("dequantize", w.weight_diff, w.weight_diff.bits, W * S)
    if w.stage >= 1 and w.grads:
        calls = w.grad_accum if w.stage >= 2 else 1
        ib, cb = w.grads.hop_bits
        if N > 1 and R > 1:
            add("quantize", w.grads, ib, calls * W * S)
            add("dequantize_sum_requantize", w.grads, ib, calls * W * S)
            add("dequantize_sum", w.grads, cb, calls * N * S)
        else:
            bits = ib if N == 1 else cb
            add("quantize", w.grads, bits, calls * W * S)
            add("dequantize_sum", w.grads, bits, calls * W * S)
    return out


def quant_work(w: Workload, c: Cluster) -> dict[tuple[str, int], int]:
    """Full-precision input elements each kernel op processes per rank per step, ``{(op, bits): n}``,
    as zeropp.comm runs them (one call per communication unit):

    * qwZ all-gather: quantize my shard, dequantize the gathered ``world`` shards (every forward
      and backward, but the units ``keep_at_turn`` keeps have no backward gather; with hpZ only the
      first forward of the step, the rest read the secondary);
    * qWD: quantize my shard's difference, dequantize the world's (once per step; at stage 3 it
      replaces qwZ's forward gather);
    * qgZ, hierarchical (nodes > 1 and ranks_per_node > 1): quantize my whole gradient at the
      intra bits, fused dequantize-sum-requantize of the ``world`` received rows, dequantize-sum of
      the ``nodes`` rows from the cross hop; otherwise one quantize and one dequantize-sum of the
      whole gradient (error feedback's extra dequantize is not counted).

    Per format: :func:`quant_work_formats`.
    """
    out: dict[tuple[str, int], int] = {}
    for (op, bits, _fmt), n in quant_work_formats(w, c).items():
        out[(op, bits)] = out.get((op, bits), 0) + n
    return out


def quant_time(w: Workload, c: Cluster) -> float:
    """Seconds of quantize/dequantize kernels per rank per step: :func:`quant_work_formats` at the
    workload's measured ``quant_rates``, looked up by ``(op, format)`` first (a calibrated
    cluster file's key), then ``(op, bits)`` (``calibration.measure_quant_rates``' key), else
    ``quant_gbs``."""
    rates = {(op, key): gbs for op, key, gbs in w.quant_rates}
    return sum(
        n * w.dtype_bytes / (rates.get((op, fmt), rates.get((op, bits), w.quant_gbs)) * 1e9)
        for (op, bits, fmt), n in quant_work_formats(w, c).items()
    )


@dataclasses.dataclass(frozen=True)
class Projection:
    """Predicted step of one workload on one cluster."""

    cluster: Cluster
    comm_s: float
    """Collectives plus quantization (``quant_s``)."""
    compute_s: float
    step_s: float
    tokens_per_s: float
    tflops_per_rank: float
    node_cross_bytes: float
    pairwise: dict[str, float]
    uplink_bytes: float = 0.0
    """Bytes one uplink sends per step (:func:`uplink_bytes`)."""
    quant_s: float = 0.0
    """Quantize/dequantize seconds per step (:func:`quant_time`), inside ``comm_s``."""


def project(w: Workload, c: Cluster) -> Projection:
    msgs = messages(w, c)
    q = quant_time(w, c)
    comm = sum(collective_time(m, c) * m.count for m in msgs) + control_time(w, c) + q
    step = w.compute_s + comm - w.overlap * min(w.compute_s, comm)
    tps = w.tokens_per_rank * c.world / step
    return Projection(
        c,
        comm,
        w.compute_s,
        step,
        tps,
        w.flops_per_token * w.tokens_per_rank / step / 1e12,
        node_cross_bytes(msgs, c),
        pairwise_bytes(msgs),
        uplink_bytes(msgs, c),
        q,
    )


def gpt_units(
    *, vocab: int, seq_len: int, d_model: int, n_layers: int, mlp_ratio: int = 4, tie_embeddings: bool = True
) -> tuple[int, ...]:
    """Communication units of zeropp's GPT: root (embeddings, final norm, head), then each block.
    With ``tie_embeddings`` (the GPT's default) the head's weight is the token embedding, counted once."""
    d, h = d_model, d_model * mlp_ratio
    root = vocab * d + seq_len * d + 2 * d + (0 if tie_embeddings else d * vocab) + vocab
    block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * h + h) + (h * d + d)
    return (root, *([block] * n_layers))
