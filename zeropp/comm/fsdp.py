"""FSDP2 plug-in: qwZ and qgZ as FSDP2's custom all-gather / reduce-scatter.

``fully_shard`` models accept custom collectives per FSDP module
(``set_custom_all_gather`` / ``set_custom_reduce_scatter``, torch >= 2.8). The contracts
FSDP2 relies on, and how they are kept here:

- all-gather: the input is a view into the output buffer; ``quantized_all_gather`` quantizes
  the input before anything is written to the output. FSDP2 gathers a flat concatenation of
  the module's shards in one dtype; a ``uint8`` gather (mixed-dtype or custom
  ``fsdp_pre_all_gather`` parameters) carries raw bytes and is never quantized; a float64
  gather or reduce-scatter under a quantized spec is refused (the kernels take fp32 / bf16 /
  fp16), rather than sent unquantized against the spec.
- reduce-scatter: ``op`` is AVG, SUM or PREMUL_SUM(1/factor) (custom gradient divide factor).
  The quantized path implements all three itself (AVG divides by the whole group), and the
  plain path emulates PREMUL_SUM on gloo, which has none. FSDP2 always calls it synchronously.
- the returned handle subclasses ``dist.Work``, which FSDP2 tests for before calling ``wait()``.

Usage::

    for layer in model.layers: fully_shard(layer)
    fully_shard(model)
    apply_zeropp_comms(model, weights=QuantSpec(bits=8), grads=QuantSpec(bits=4), topology=Topology(2, 2))
    # or a named recipe: apply_zeropp_comms(model, recipe="w8g4", topology=Topology(2, 2))

Communication state: the modules of one ``apply_zeropp_comms`` call share one
:class:`~.session.CommSession` (its topology, stats, stochastic-rounding counter and side
streams), given as ``session=`` or created for that call, so a second model in the process (or
a ZeroEngine beside it) never shares its counters by accident.

hpZ is not a collective here: FSDP2's own secondary partition is
``fully_shard(..., reshard_after_forward=<ranks per node>)``, so a recipe with ``hpz=True`` is
refused rather than silently dropped.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from zeropp.kernels.layout import QUANT_FLOAT_DTYPES

from .backend import ReduceOpLike, check_gather_spec, check_reduce_spec, check_spec_type
from .collectives import quantized_all_gather, quantized_reduce_scatter
from .feedback import ErrorFeedback
from .kinds import CommKind
from .session import CommSession
from .spec import QuantRecipe, QuantSpec
from .stats import CommStats
from .topology import Topology


def make_session(
    session: Optional[CommSession], topology: Optional[Topology], stats: Optional[CommStats], owner: str
) -> CommSession:
    """``session`` as given, or a new one over ``topology`` / ``stats``; a session together with a
    topology or stats other than its own is ambiguous, hence refused."""
    if session is None:
        return CommSession(topology, stats=stats)
    if not isinstance(session, CommSession):
        raise TypeError(f"{owner}: session must be a zeropp.comm.CommSession or None, got {type(session).__name__}")
    if (topology is not None and topology != session.topology) or (stats is not None and stats is not session.stats):
        raise ValueError(
            f"{owner}: pass either session= or topology=/stats=, not both (the session holds its own "
            f"topology and stats: CommSession(topology, stats=stats))"
        )
    return session


def _check_dtype(spec: Optional[QuantSpec], t: torch.Tensor, which: str, does: str) -> None:
    """A float64 payload under a quantized spec is refused, naming the plug-in's own settings: the
    quantized kernels take float32, bfloat16 and float16, and gathering float64 weights plain
    would silently ignore the spec asked for. Other dtypes are FSDP2's packed forms (``uint8``
    raw bytes of mixed-dtype or custom ``fsdp_pre_all_gather`` parameters, float8 payloads):
    already compact, gathered as they are."""
    if spec is not None and t.dtype == torch.float64:
        raise ValueError(
            f"apply_zeropp_comms: FSDP2 {does} as torch.float64, but quantized collectives take float32, "
            f"bfloat16 or float16; keep the model in one of those dtypes (or set fully_shard's "
            f"MixedPrecisionPolicy param_dtype / reduce_dtype to one), or pass {which}=None to send float64 "
            f"unquantized"
        )


class _Alloc:
    """Plain ``torch.empty`` buffers (FSDP2 frees them when the module reshards)."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)


class QuantizedAllGather(_Alloc, AllGather):
    """qwZ for FSDP2: each rank's flat shard quantized by ``spec`` (None = plain, accounted);
    stochastic rounding and its seed as in ``quantized_all_gather``. ``session``: the
    communication state (else a new session over ``topology`` / ``stats``)."""

    def __init__(
        self,
        spec: Optional[QuantSpec] = None,
        *,
        topology: Optional[Topology] = None,
        stats: Optional[CommStats] = None,
        kind: str = CommKind.FSDP_ALL_GATHER,
        session: Optional[CommSession] = None,
    ) -> None:
        self.spec = check_gather_spec(spec)  # fail here, not in the first forward
        self.session = make_session(session, topology, stats, "QuantizedAllGather")
        self.kind = kind

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> Optional[dist.Work]:
        _check_dtype(self.spec, input_tensor, "weights", "gathers this module's parameters")
        spec = self.spec if input_tensor.dtype in QUANT_FLOAT_DTYPES else None  # raw bytes: never quantize
        return quantized_all_gather(
            output_tensor, input_tensor, group, spec=spec, kind=self.kind, async_op=async_op, session=self.session
        )


class QuantizedReduceScatter(_Alloc, ReduceScatter):
    """qgZ for FSDP2: hierarchical when the group is the topology's whole multi-node world.

    ``spec.error_feedback=True`` keeps this module's residual in an :class:`ErrorFeedback` the
    instance owns (one instance per FSDP module, which :func:`apply_zeropp_comms` ensures; the
    bucket is keyed by its size so a changed layout starts a fresh residual instead of failing).
    ``session``: the communication state (else a new session over ``topology`` / ``stats``)."""

    def __init__(
        self,
        spec: Optional[QuantSpec] = None,
        *,
        topology: Optional[Topology] = None,
        stats: Optional[CommStats] = None,
        kind: str = CommKind.FSDP_REDUCE_SCATTER,
        error_feedback: Optional[ErrorFeedback] = None,
        key_prefix: str = "",
        session: Optional[CommSession] = None,
    ) -> None:
        check_spec_type(spec)
        self.spec = spec
        self.session = make_session(session, topology, stats, "QuantizedReduceScatter")
        self.kind = kind
        if error_feedback is None and spec is not None and spec.error_feedback:
            error_feedback = ErrorFeedback.for_spec(spec)
        self.error_feedback = error_feedback
        """The residuals: this instance's own, or a state shared by the modules of one model
        (``apply_zeropp_comms(error_feedback=...)``, each module's buckets under its ``key_prefix``)."""
        self.key_prefix = key_prefix
        check_reduce_spec(spec, self.error_feedback)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: ReduceOpLike,
        async_op: bool = False,
    ) -> Optional[dist.Work]:
        _check_dtype(self.spec, input_tensor, "grads", "reduces this module's gradients")
        return quantized_reduce_scatter(
            output_tensor,
            input_tensor,
            op,
            group,
            spec=self.spec,
            error_feedback=self.error_feedback,
            feedback_key=f"{self.key_prefix}numel{input_tensor.numel()}",
            kind=self.kind,
            async_op=async_op,
            session=self.session,
        )


def apply_zeropp_comms(
    model: torch.nn.Module,
    *,
    weights: Optional[QuantSpec] = None,
    grads: Optional[QuantSpec] = None,
    recipe: Union[QuantRecipe, str, None] = None,
    topology: Optional[Topology] = None,
    stats: Optional[CommStats] = None,
    error_feedback: Optional[ErrorFeedback] = None,
    session: Optional[CommSession] = None,
) -> int:
    """Install qwZ (``weights``) / qgZ (``grads``) on every FSDP module of ``model`` (after
    ``fully_shard``); returns how many modules were set. A None spec keeps the plain collective
    (still byte-accounted). ``recipe`` (a :class:`QuantRecipe` or a name in ``RECIPES``) sets both
    instead, so it excludes ``weights`` / ``grads``; a recipe with ``hpz=True`` is refused (use
    FSDP2's own ``reshard_after_forward=<ranks per node>``). ``error_feedback``: one state for all
    modules (each module's residuals keyed by its qualified name), which the caller can save with a
    checkpoint (``state_dict()``) and load on resume; None gives each module its own.
    ``session``: the :class:`CommSession` all modules use (its stats, stochastic-rounding counter,
    wait hooks); None creates one over ``topology`` / ``stats`` for this model (pass one to read its
    counter for a checkpoint, or to time its waits)."""
    if recipe is not None:
        if weights is not None or grads is not None:
            raise ValueError(
                f"apply_zeropp_comms: pass either recipe={recipe!r} or weights=/grads=, not both "
                f"(a recipe sets both specs)"
            )
        if isinstance(recipe, str):
            recipe = QuantRecipe.from_name(recipe)
        if not isinstance(recipe, QuantRecipe):
            raise TypeError(f"recipe must be a QuantRecipe, a recipe name or None, got {type(recipe).__name__}")
        if recipe.hpz:
            raise ValueError(
                "apply_zeropp_comms: the recipe has hpz=True, but hpZ is not a collective under FSDP2: use "
                "fully_shard(..., reshard_after_forward=<ranks per node>) for its intra-node secondary "
                "partition, and a recipe without hpz (e.g. 'w8g4' instead of 'zeropp') here"
            )
        weights, grads = recipe.weights, recipe.grads
    check_gather_spec(weights, "weights")
    check_spec_type(grads, "grads")
    session = make_session(session, topology, stats, "apply_zeropp_comms")
    count = 0
    for name, m in model.named_modules():
        if isinstance(m, FSDPModule):
            m.set_custom_all_gather(QuantizedAllGather(weights, session=session))
            m.set_custom_reduce_scatter(
                QuantizedReduceScatter(grads, session=session, error_feedback=error_feedback, key_prefix=f"{name}:")
            )
            count += 1
    if count == 0:
        raise ValueError("apply_zeropp_comms found no FSDP module in the model; call fully_shard(...) first")
    return count
