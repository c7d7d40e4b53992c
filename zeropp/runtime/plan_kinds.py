"""The vocabulary of a step's communication: kinds, groups, links, algorithms, and the bucketing rule.

Why one module: the engine records its collectives under kind strings (``CommStats`` keys, which
also name the runner's summary fields and wandb keys), the byte and time models name the same
kinds, and the engine and the models each cut a large collective into bucket chunks. Declaring
each spelling and the chunking rule once here lets :mod:`zeropp.runtime.plan` (the one declaration
of a step's communication) and everything that reads it agree by construction.

Every enum is a ``str`` enum whose values are today's strings, so a member compares equal to, hashes
like and formats as the string it replaces: nothing changes on the wire, in ``CommStats`` snapshots,
in summaries or in wandb keys.
"""

from __future__ import annotations

from zeropp.comm.choices import StrChoice as _StrEnum  # prints, formats and repr's as its value
from zeropp.comm.kinds import CommKind
from zeropp.comm.spec import QuantSpec
from zeropp.kernels import DEFAULT_GRAD_GROUP_SIZE, DEFAULT_WEIGHT_GROUP_SIZE

STEP_KINDS = (
    CommKind.FWD_ALL_GATHER,
    CommKind.BWD_ALL_GATHER,
    CommKind.FROZEN_ALL_GATHER,
    CommKind.GRAD_REDUCE_SCATTER,
    CommKind.GRAD_ALL_REDUCE,
    CommKind.PARAM_ALL_GATHER,
    CommKind.WEIGHT_DIFF_ALL_GATHER,
    CommKind.CONTROL,
)
"""The kinds a ZeroEngine training step issues (what a :class:`~zeropp.runtime.plan.CommPlan` holds)."""


class Group(_StrEnum):
    """The process group a collective runs over (``zeropp.comm.topology``'s families)."""

    WORLD = "world"
    """ZeRO's data-parallel world (the default group, or the dp group when ``tp > 1``)."""
    INTRA = "intra"
    """The (data-parallel) ranks of one node: qgZ's first hop."""
    CROSS = "cross"
    """One rank per node, same local index: qgZ's second hop."""
    HPZ = "hpz"
    """hpZ's secondary-partition group inside a node."""
    TP = "tp"
    """The tensor-parallel ranks of a node."""
    DEFAULT = "default"
    """Every rank, tensor-parallel ones included (the control scalars)."""


class Link(_StrEnum):
    """A link class: ``CommStats`` splits a rank's sent bytes into these."""

    INTRA = "intra"
    CROSS = "cross"


class Algo(_StrEnum):
    """How a collective moves its bytes (what the time model charges)."""

    RING_AG = "ring_ag"
    """All-gather: this rank's chunk to every other member."""
    RING_RS = "ring_rs"
    """Reduce-scatter: each member's chunk to it."""
    ALL_REDUCE = "all_reduce"
    """All-reduce: ``2 / g`` of the buffer to each member (both halves in one chunk)."""
    A2A_INTRA = "a2a_intra"
    """qgZ's intra-node all-to-all."""
    A2A_CROSS = "a2a_cross"
    """qgZ's cross-node all-to-all (one rank per node)."""


class Phase(_StrEnum):
    """Where in a step a collective is issued."""

    FWD = "fwd"
    """Before a unit's forward (stage-3 gathers)."""
    BWD = "bwd"
    """Before a unit's backward (stage-3 gathers)."""
    REDUCE = "reduce"
    """After a unit's backward (stages 2-3), or after the last backward (stages 0-1)."""
    POST = "post"
    """After the optimizer step (parameter refresh)."""
    CONTROL = "control"
    """The uncounted scalar all-reduces."""


def chunk_ranges(cols: int, rows: int, bucket: int) -> list[tuple[int, int]]:
    """Column ranges ``[a, b)`` of a ``[rows, cols]`` collective cut so that each chunk moves at most
    ``bucket`` elements: the whole buffer when it fits, else equal chunks of ``max(1, bucket // rows)``
    columns, the last one shorter. Each chunk is one call, quantized with its own scales. (A bucket
    smaller than a row still sends one column per call rather than refusing.)"""
    if cols < 0 or rows < 1 or bucket < 1:
        raise ValueError(
            f"chunk_ranges(cols={cols}, rows={rows}, bucket={bucket}): need cols >= 0, rows >= 1, bucket >= 1"
        )
    if rows * cols <= bucket:
        return [(0, cols)]
    c = max(1, bucket // rows)
    return [(a, min(a + c, cols)) for a in range(0, cols, c)]


def group_size_of(spec: QuantSpec, *, weights: bool) -> int:
    """Elements per quantization scale of ``spec``: its own ``group_size``, else the kernels' default
    for weights (qwZ, qWD, MixZ++) or for gradients (qgZ)."""
    return spec.group_size or (DEFAULT_WEIGHT_GROUP_SIZE if weights else DEFAULT_GRAD_GROUP_SIZE)
