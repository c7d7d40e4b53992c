"""What the cost model is asked about: the cluster, the workload, and the messages it sends.

:class:`Cluster` (nodes, ranks, links and how the backend moves bytes over them),
:class:`Workload` (one training step: the communication units, the ZeRO / ZeRO++ switches, the
compute time) and :class:`Message` (one collective call of the step), plus the units they are in
(:data:`GBPS`). The formulas over them are in ``scaling.py``; the tables in ``speedup.py``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from zeropp.comm.spec import QuantSpec
from zeropp.runtime.plan_kinds import group_size_of

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
    coalesce: int = 0
    """Elements up to which consecutive blocks share one unit, so one gather and one reduce-scatter
    (``ZeroConfig.coalesce_numel``; ``units`` stay one per block, the plan merges them); 0: one unit per block."""
    keep_at_turn: bool = False
    """Stage 3: the root and the last block stay gathered from forward into backward, so their
    backward gathers are not sent (``ZeroConfig.keep_at_turn``)."""
    overlap: float = 0.0
    """Fraction of min(compute, comm) hidden by overlap (0: fully serialized)."""
    flops_per_token: float = 0.0
    """For TFLOP/s in the projection (optional)."""
    quant_gbs: float = 500.0
    """Quantize/dequantize kernel throughput (GB/s of full-precision input data) for every op not
    in ``quant_rates``; their time is not hidden under compute."""
    quant_rates: tuple[tuple[str, int | str, float], ...] = ()
    """Measured ``(op, bits or format, GB/s of full-precision input)`` per kernel op (see
    ``scaling.QUANT_OPS``; ``calibration.measure_quant_rates`` keys by bits, a calibrated cluster
    file by format, ``scaling.format_name``: ``int4`` and ``mxfp4`` are both 4 bits); overrides
    ``quant_gbs`` for the ops listed, a format key before a bits key."""

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
            ("coalesce", self.coalesce >= 0, "use >= 0 elements (0: one unit per block)"),
            ("keep_at_turn", not self.keep_at_turn or self.stage == 3, "only stage 3 gathers; set stage=3 or False"),
            ("overlap", 0.0 <= self.overlap <= 1.0, "use a fraction in [0, 1]"),
            ("compute_s", self.compute_s >= 0, "use >= 0"),
            ("quant_gbs", self.quant_gbs > 0, "use a positive rate"),
        )
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"Workload.{name}={getattr(self, name)!r}; {allowed}")

    def coalesced(self) -> Workload:
        """This workload with its blocks merged as ``coalesce`` merges them (``blocks.coalesce_spans``)
        and ``coalesce=0``: one entry of ``units`` per unit the engine gathers and reduces, so
        per-unit models (shards padded per unit, per-unit costs and the step schedule) see the units
        the plan's messages are numbered by. A workload has no frozen counts, so spans are sized by
        its (trainable) elements; the engine and the plan size them by trainable plus frozen ones:
        for a model with frozen parameters, give the plan's merged units (``coalesce=0``) instead."""
        if not self.coalesce or len(self.units) < 3:
            return dataclasses.replace(self, coalesce=0)
        from zeropp.runtime.blocks import coalesce_spans

        blocks = self.units[1:]
        merged = tuple(sum(blocks[a : b + 1]) for a, b in coalesce_spans(list(blocks), self.coalesce))
        return dataclasses.replace(self, units=(self.units[0], *merged), coalesce=0)

    def kept_at_turn(self) -> frozenset[int]:
        """Indices into :meth:`coalesced` ``.units`` (the units the engine moves) that
        ``keep_at_turn`` keeps gathered from forward into backward: the root and the last unit;
        empty without it."""
        if not self.keep_at_turn:
            return frozenset()
        return frozenset({0, len(self.coalesced().units) - 1})

    @classmethod
    def from_zero(
        cls, zero: ZeroConfig | Any, *, units: tuple[int, ...], compute_s: float, tokens_per_rank: int, **kw: Any
    ) -> Workload:
        """The workload of a run with these ZeRO settings: stage, ``weights``, ``grads``, hpZ, the
        wire dtype (``precision``) and micro-batches per step (``grad_accum_steps``) come from
        ``zero`` (a ``ZeroConfig``, or any object with those attributes; bucket sizes,
        ``coalesce_numel`` and ``keep_at_turn`` too when it has them); ``kw`` sets the rest. A ``persistence_threshold`` is refused: the model has no
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
        if getattr(zero, "coalesce_numel", None) is not None:
            buckets["coalesce"] = zero.coalesce_numel
        if getattr(zero, "keep_at_turn", None) is not None:
            buckets["keep_at_turn"] = zero.keep_at_turn
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
    """Index of the unit it moves in ``Workload.coalesced().units`` (the plan's units; -1: none, e.g. a
    control message)."""
    phase: str = ""
    """Where the engine issues it (a ``zeropp.runtime.plan_kinds.Phase``: fwd, bwd, reduce, post)."""
