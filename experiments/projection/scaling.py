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
(``Workload.quant_rates``, see ``scaling_check.measure_quant_rates``) or ``quant_gbs``.
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

``python -m experiments.scaling`` prints the projection for 8 GPUs/node at 100 and 400 Gbps up
to 384 GPUs and saves ``outputs/scaling.png``. Checking the model against measured runs is
``scaling_check.py`` (``python -m experiments.scaling_check DIR [--calibrate]``), which imports
this module, never the other way round.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Iterable

from zeropp.comm.spec import RECIPES, QuantSpec
from zeropp.runtime.choices import Precision
from zeropp.runtime.plan import CONTROL_BYTES, CommPlan, build_plan
from zeropp.runtime.plan_kinds import CommKind, chunk_ranges, group_size_of

from .text_table import Column, number, text_table

if TYPE_CHECKING:
    from zeropp.runtime import ZeroConfig

GBPS = 1e9 / 8  # bytes per second in one Gbit/s
WIRES = ("pairwise", "ring")
"""Backend schedules of :attr:`Cluster.wire`."""
BIG_BUCKET = 500_000_000
"""``ZeroConfig``'s default bucket sizes (elements): no chunking for any unit we model."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cluster:
    """Shape and links of a (real or projected) cluster."""

    nodes: int
    """Number of nodes."""
    ranks_per_node: int
    """GPUs (ranks) per node."""
    cross_gbps: float
    """Rate of one cross-node uplink (one NIC), Gbit/s, each direction."""
    intra_gbps: float = 1200.0
    """Per-rank intra-node bandwidth (NVLink/NVSwitch; ~150 GB/s on V100 DGX), Gbit/s."""
    alpha_cross_s: float = 20e-6
    """Latency of one cross-node message step."""
    alpha_intra_s: float = 5e-6
    """Latency of one intra-node message step."""
    nics_per_node: int | None = None
    """Cross-node uplinks (NICs) per node; ``None`` = one per rank (8-GPU nodes with 8 NICs, the
    usual GPU cluster). Each uplink is shared by ``ranks_per_node / nics_per_node`` ranks
    (:attr:`ranks_per_uplink`): the emulator has one shared uplink per node (``nics_per_node=1``)."""
    parallel_links: bool = True
    """Intra- and cross-node transfers proceed at once (GPUs: NVLink beside the NICs). False for
    CPU ranks sharing cores (the emulator), where the two add up."""
    comm_on_compute: bool = False
    """The ranks' processors do the collectives' per-message work and intra-node copies (CPU ranks
    under gloo, the emulator), so in the scheduled step (``experiments.projection.step_schedule``) those
    terms occupy the compute resource; False (GPUs): they run beside compute, only quantization
    kernels compete with it. The serial :func:`project` does not use it."""
    wire: str = "pairwise"
    """How the backend moves the plain collectives' bytes over the uplinks (:func:`uplink_bytes`):
    ``"pairwise"`` -- every rank sends each peer its chunk directly (CommStats' convention);
    ``"ring"`` -- gloo: all-gather as a ring in rank order (one cross edge leaves each node,
    carrying ``g - 1`` chunks), reduce-scatter and all-reduce as a ring all-reduce (``2 (g - 1)``
    chunks on that edge); all-to-alls are pairwise under both."""

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.ranks_per_node < 1 or self.cross_gbps <= 0 or self.intra_gbps <= 0:
            raise ValueError(f"invalid cluster {self}")
        nics = self.nics_per_node
        if nics is not None and (nics < 1 or self.ranks_per_node % nics):
            raise ValueError(f"nics_per_node={nics} must be >= 1 and divide ranks_per_node={self.ranks_per_node}")
        if self.wire not in WIRES:
            raise ValueError(f"Cluster.wire={self.wire!r}; use one of {WIRES}")

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def ranks_per_uplink(self) -> int:
        """Ranks whose cross-node sends share one uplink (1 with one NIC per rank)."""
        return self.ranks_per_node // (self.nics_per_node or self.ranks_per_node)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """What is trained, per rank, independent of the cluster size (weak scaling)."""

    units: tuple[int, ...]
    """Elements of each communication unit (root first, then one per block)."""
    compute_s: float
    """Forward+backward+optimizer compute time of one step on one rank."""
    tokens_per_rank: int
    """Tokens one rank processes per step."""
    stage: int = 3
    """ZeRO stage 0-3 (as ``ZeroConfig.stage``)."""
    weights: QuantSpec | None = None
    """qwZ: the spec of the stage-3 weight all-gathers (``ZeroConfig.weights``); None = full precision."""
    grads: QuantSpec | None = None
    """qgZ: the spec of the gradient reduce-scatters (``ZeroConfig.grads``; its ``hop_bits`` are the
    intra-/cross-node bits of the hierarchical all-to-all); None = full precision."""
    hpz: bool = False
    """hpZ: backward gathers stay inside the hpZ group (``ZeroConfig.hpz``)."""
    hpz_size: int | None = None
    """Ranks of a hpZ group; None = the node (``ZeroConfig.hpz_size``)."""
    weight_diff: QuantSpec | None = None
    """qWD (``ZeroConfig.weight_diff``): the parameter refresh after the step sends quantized
    differences instead of weights. Stages 1-2: it replaces the parameter all-gather. Stage 3 (with
    hpZ): the secondaries persist, so in the steady state (from the second step on, what this
    model describes) every forward and backward gather reads the secondary inside the hpZ group
    and one quantized difference gather over the world per unit replaces qwZ's forward gather."""
    dtype_bytes: int = 2
    """Bytes per element of weights/gradients on the wire when not quantized (bf16/fp16: 2)."""
    grad_accum: int = 1
    """Micro-batches per step (``ZeroConfig.grad_accum_steps``): stage 3 gathers and stage 2-3
    reduce-scatters run once per micro-batch."""
    allgather_bucket: int = BIG_BUCKET
    """Elements per all-gather call (``ZeroConfig.allgather_bucket_size``): a larger gather is cut
    into column chunks of at most this many elements, each quantized with its own scales."""
    reduce_bucket: int = BIG_BUCKET
    """Elements per reduce-scatter call (``ZeroConfig.reduce_bucket_size``), likewise."""
    overlap: float = 0.0
    """Fraction of min(compute, comm) hidden by overlap (0: fully serialized)."""
    flops_per_token: float = 0.0
    """For TFLOP/s in the projection (optional)."""
    quant_gbs: float = 500.0
    """Quantize/dequantize kernel throughput (GB/s of full-precision input data) for every op not
    in ``quant_rates``; their time is not hidden under compute."""
    quant_rates: tuple[tuple[str, int, float], ...] = ()
    """Measured ``(op, bits, GB/s of full-precision input)`` per kernel op (see :data:`QUANT_OPS`
    and ``scaling_check.measure_quant_rates``); overrides ``quant_gbs`` for the ops listed."""

    def __post_init__(self) -> None:
        checks = (
            ("units", bool(self.units) and min(self.units) >= 1, "give every unit's element count (>= 1)"),
            ("stage", self.stage in (0, 1, 2, 3), "use 0, 1, 2 or 3"),
            ("weights", self.weights is None or self.stage == 3, "qwZ gathers exist at stage 3 only; set stage=3"),
            ("hpz", not self.hpz or self.stage == 3, "hpZ partitions stage-3 weights; set stage=3 or hpz=False"),
            ("grads", self.grads is None or self.stage >= 1, "stage 0 all-reduces; set stage>=1 or grads=None"),
            ("hpz_size", self.hpz_size is None or self.hpz_size >= 1, "use a positive group size or None (the node)"),
            (
                "weight_diff",
                self.weight_diff is None or self.stage in (1, 2) or (self.stage == 3 and self.hpz),
                "weight differences refresh stages 1-2 replicas or stage 3's hpZ secondaries; set stage 1-2, or hpz=True",
            ),
            ("dtype_bytes", self.dtype_bytes in (2, 4), "use 2 (bf16/fp16) or 4 (fp32)"),
            ("grad_accum", self.grad_accum >= 1, "use >= 1"),
            ("allgather_bucket", self.allgather_bucket >= 1, "use >= 1 element"),
            ("reduce_bucket", self.reduce_bucket >= 1, "use >= 1 element"),
            ("overlap", 0.0 <= self.overlap <= 1.0, "use a fraction in [0, 1]"),
            ("compute_s", self.compute_s >= 0, "use >= 0"),
            ("quant_gbs", self.quant_gbs > 0, "use a positive rate"),
        )
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"Workload.{name}={getattr(self, name)!r}; {allowed}")

    @classmethod
    def from_zero(
        cls, zero: ZeroConfig | Any, *, units: tuple[int, ...], compute_s: float, tokens_per_rank: int, **kw: Any
    ) -> Workload:
        """The workload of a run with these ZeRO settings: stage, ``weights``, ``grads``, hpZ, the
        wire dtype (``precision``) and micro-batches per step (``grad_accum_steps``) come from
        ``zero`` (a ``ZeroConfig``, or any object with those attributes; bucket sizes too when it
        has them); ``kw`` sets the rest. A ``persistence_threshold`` is refused: the model has no
        replicated stage-3 unit, so its bytes would be silently wrong."""
        if getattr(zero, "persistence_threshold", 0):
            raise ValueError(
                f"ZeroConfig.persistence_threshold={zero.persistence_threshold} is not modelled (its "
                "parameters form an all-reduced unit); project runs with persistence_threshold=0"
            )
        buckets = {
            k: getattr(zero, f"{k}_size")
            for k in ("allgather_bucket", "reduce_bucket")
            if getattr(zero, f"{k}_size", None) is not None
        }
        return cls(
            units=tuple(units),
            compute_s=compute_s,
            tokens_per_rank=tokens_per_rank,
            stage=zero.stage,
            weights=zero.weights,
            grads=zero.grads,
            hpz=zero.hpz,
            hpz_size=zero.hpz_size,
            weight_diff=getattr(zero, "weight_diff", None),
            dtype_bytes=4 if zero.precision == "fp32" else 2,
            grad_accum=zero.grad_accum_steps,
            **{**buckets, **kw},
        )

    @property
    def weight_group_size(self) -> int:
        """Elements per scale of the weight gathers: the spec's, else the kernels' default."""
        return group_size_of(self.weights or QuantSpec(bits=8), weights=True)

    @property
    def grad_group_size(self) -> int:
        """Elements per scale of the gradient reduce-scatters: the spec's, else the kernels' default."""
        return group_size_of(self.grads or QuantSpec(bits=8), weights=False)

    def with_zero(self, **kw: object) -> Workload:
        """A copy with other ZeRO settings (e.g. ``**ZEROPP``), validated."""
        return dataclasses.replace(self, **kw)  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True)
class Message:
    """One collective call of a step: ``count`` calls per step of this shape (the time model's
    view of :class:`zeropp.runtime.plan.Collective`, identical calls merged)."""

    kind: str
    """CommStats kind the engine records it under (a ``CommKind``)."""
    algo: str  # "ring_ag", "ring_rs", "all_reduce", "a2a_intra", "a2a_cross" (an ``Algo``)
    nodes: int  # nodes the group spans
    ranks: int  # group ranks per node
    chunk_bytes: int  # bytes this rank sends to each peer (all-reduce: both halves)
    count: int
    unit: int = -1
    """Index into ``Workload.units`` of the unit it moves (-1: none, e.g. a control message)."""
    phase: str = ""
    """Where the engine issues it (a ``zeropp.runtime.plan_kinds.Phase``: fwd, bwd, reduce, post)."""


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


def quant_work(w: Workload, c: Cluster) -> dict[tuple[str, int], int]:
    """Full-precision input elements each kernel op processes per rank per step, ``{(op, bits): n}``,
    as zeropp.comm runs them (one call per communication unit):

    * qwZ all-gather: quantize my shard, dequantize the gathered ``world`` shards (every forward
      and backward; with hpZ only the first forward of the step, the rest read the secondary);
    * qWD: quantize my shard's difference, dequantize the world's (once per step; at stage 3 it
      replaces qwZ's forward gather);
    * qgZ, hierarchical (nodes > 1 and ranks_per_node > 1): quantize my whole gradient at the
      intra bits, fused dequantize-sum-requantize of the ``world`` received rows, dequantize-sum of
      the ``nodes`` rows from the cross hop; otherwise one quantize and one dequantize-sum of the
      whole gradient (error feedback's extra dequantize is not counted).
    """
    W, R, N = c.world, c.ranks_per_node, c.nodes
    S = sum(-(-u // W) for u in w.units)  # elements of my shards
    out: dict[tuple[str, int], int] = {}

    def add(op: str, bits: int, n: int) -> None:
        out[(op, bits)] = out.get((op, bits), 0) + n

    if w.stage == 3 and w.weights and not w.weight_diff:
        gathers = 1 if w.hpz else 2 * w.grad_accum
        add("quantize", w.weights.bits, gathers * S)
        add("dequantize", w.weights.bits, gathers * W * S)
    if w.weight_diff:  # qWD: quantize my shard's difference, dequantize the world's
        add("quantize", w.weight_diff.bits, S)
        add("dequantize", w.weight_diff.bits, W * S)
    if w.stage >= 1 and w.grads:
        calls = w.grad_accum if w.stage >= 2 else 1
        ib, cb = w.grads.hop_bits
        if N > 1 and R > 1:
            add("quantize", ib, calls * W * S)
            add("dequantize_sum_requantize", ib, calls * W * S)
            add("dequantize_sum", cb, calls * N * S)
        else:
            bits = ib if N == 1 else cb
            add("quantize", bits, calls * W * S)
            add("dequantize_sum", bits, calls * W * S)
    return out


def quant_time(w: Workload, c: Cluster) -> float:
    """Seconds of quantize/dequantize kernels per rank per step: :func:`quant_work` at the
    workload's measured ``quant_rates`` (else ``quant_gbs``)."""
    rates = {(op, bits): gbs for op, bits, gbs in w.quant_rates}
    return sum(n * w.dtype_bytes / (rates.get(key, w.quant_gbs) * 1e9) for key, n in quant_work(w, c).items())


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
) -> list[dict[str, float]]:
    """ZeRO-3 vs ZeRO++ for 1..max_ranks/ranks_per_node nodes at each bandwidth, projected by
    ``projector`` (default :func:`project`; ``step_schedule.project_scheduled`` for overlap)."""
    projector = projector or project
    rows = []
    base = w.with_zero(weights=None, hpz=False, grads=None)
    plus = w.with_zero(**ZEROPP)
    node_counts = sorted(
        {n for n in (1, 2, 4, 8, 16, 24, 32, 48) if n * ranks_per_node <= max_ranks} | {max_ranks // ranks_per_node}
    )
    for bw in gbps:
        for n in node_counts:
            c = Cluster(nodes=n, ranks_per_node=ranks_per_node, cross_gbps=bw, nics_per_node=nics_per_node)
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
    Column(title="NIC Gbps", width=8, cell=number("gbps", ".0f")),
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


def plot(rows: list[dict[str, float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, bw in enumerate(sorted({r["gbps"] for r in rows})):
        rs = [r for r in rows if r["gbps"] == bw]
        g = [r["gpus"] for r in rs]
        color = f"C{i}"
        ax1.plot(g, [r["zero3_tflops"] for r in rs], "o--", color=color, label=f"ZeRO-3 {bw:.0f} Gbps/NIC")
        ax1.plot(g, [r["zeropp_tflops"] for r in rs], "s-", color=color, label=f"ZeRO++ {bw:.0f} Gbps/NIC")
        ax2.plot(g, [r["speedup"] for r in rs], "o-", color=color, label=f"{bw:.0f} Gbps/NIC")
    ax1.set(xlabel="GPUs", ylabel="TFLOP/s per GPU", title="Projected throughput", xscale="log")
    ax2.set(xlabel="GPUs", ylabel="ZeRO++ / ZeRO-3", title="Projected speedup", xscale="log")
    ax2.axhline(1.0, color="grey", lw=0.5)
    for ax in (ax1, ax2):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(
    argv: list[str] | None = None,
    *,
    projector: Callable[[Workload, Cluster], Projection] | None = None,
    prog: str = "python -m experiments.scaling",
) -> None:
    """The projection table and plot; ``projector`` as in :func:`speedup_table` (the scheduled
    model's CLI, ``python -m experiments.step_schedule``, passes its own)."""
    import argparse
    from pathlib import Path

    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--gbps", type=float, nargs="+", default=[100.0, 400.0], help="Gbit/s of one cross-node NIC")
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument(
        "--nics-per-node",
        type=int,
        default=None,
        help="cross-node NICs per node, each shared by ranks-per-node/nics ranks (default: one per GPU)",
    )
    ap.add_argument("--max-gpus", type=int, default=384)
    ap.add_argument("--tokens-per-gpu", type=int, default=1024)
    ap.add_argument("--tflops", type=float, default=50.0, help="achieved compute TFLOP/s per GPU")
    ap.add_argument("--overlap", type=float, default=0.0, help="fraction of comm hidden under compute")
    ap.add_argument(
        "--plot",
        default="outputs/scaling.png" if projector is None else "outputs/scaling_scheduled.png",
        help="where to save the plot ('' to skip)",
    )
    a = ap.parse_args(argv)
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
        f"quantization at {w.quant_gbs:g} GB/s; "
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
    )
    print(format_table(rows))
    if a.plot:
        Path(a.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(rows, a.plot)
        print(f"plot: {a.plot}")


if __name__ == "__main__":
    main()
