"""The kinds of communication: one spelling of every ``CommStats`` key (:class:`CommKind`).

Why here, in ``zeropp.comm``: the collectives record their bytes under a kind, and both the
library's plug-ins (``ddp.py``, ``fsdp.py``) and the engine (``zeropp.runtime``, which imports this
package) name kinds; declaring them at the lowest floor that uses them lets every caller import
the one declaration. ``zeropp.runtime.plan_kinds`` re-exports :class:`CommKind` beside the plan's
other vocabulary.

A ``str`` enum whose values are the strings the kinds always had: a member compares equal to,
hashes like and formats as its string, so nothing changes in ``CommStats`` snapshots, summaries
or wandb keys.
"""

from __future__ import annotations

from zeropp.comm.choices import StrChoice

__all__ = ["CommKind"]


class CommKind(StrChoice):
    """What a collective is for: the ``kind`` it is recorded under in ``zeropp.comm.CommStats``."""

    FWD_ALL_GATHER = "fwd_all_gather"
    """Stage 3: a unit's parameters gathered before its forward (qwZ quantizes it)."""
    BWD_ALL_GATHER = "bwd_all_gather"
    """Stage 3: a unit's parameters gathered again before its backward (hpZ: inside the group)."""
    FROZEN_ALL_GATHER = "frozen_all_gather"
    """Stage 3: a frozen unit's gather, forward and backward alike (MixZ++: its stored wire rows)."""
    GRAD_REDUCE_SCATTER = "grad_reduce_scatter"
    """Stages 1-3: gradient reduce-scatter (qgZ: both all-to-all hops are recorded under it)."""
    GRAD_ALL_REDUCE = "grad_all_reduce"
    """Stage 0 (and replicated stage-3 units): gradient all-reduce."""
    PARAM_ALL_GATHER = "param_all_gather"
    """Stages 1-2: the updated parameter shards gathered after the optimizer step."""
    WEIGHT_DIFF_ALL_GATHER = "weight_diff_all_gather"
    """qWD: the quantized weight differences gathered after the optimizer step."""
    CHECKPOINT = "checkpoint"
    """Gathers of a checkpoint save or a consolidated state dict (not part of a training step)."""
    CONTROL = "control"
    """Loss / norm sums and the after-forward agreement: a few scalars, not counted by CommStats."""
    DDP_ALL_REDUCE = "ddp_all_reduce"
    """``zeropp.comm.ddp``'s communication hook (the DDP trainers)."""
    FSDP_ALL_GATHER = "fsdp_all_gather"
    """``zeropp.comm.fsdp``'s FSDP2 all-gather hook."""
    FSDP_REDUCE_SCATTER = "fsdp_reduce_scatter"
    """``zeropp.comm.fsdp``'s FSDP2 reduce-scatter hook."""
    ALL_GATHER = "all_gather"
    """A plain ``torch.distributed`` all-gather (``experiments.runner.commwatch``; ``zeropp.comm``'s default)."""
    REDUCE_SCATTER = "reduce_scatter"
    """A plain reduce-scatter (as above)."""
    ALL_REDUCE = "all_reduce"
    """A plain all-reduce (as above; tensor parallelism's activation sums)."""
    ALL_TO_ALL = "all_to_all"
    """A plain all-to-all (as above)."""
    BROADCAST = "broadcast"
    """A plain broadcast (as above; the engine's initial weight sync)."""
    SCATTER = "scatter"
    """A plain scatter (as above)."""
    REDUCE = "reduce"
    """A plain reduce (as above)."""
    GATHER = "gather"
    """A plain gather (as above)."""
