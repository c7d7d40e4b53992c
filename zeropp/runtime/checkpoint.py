"""ZeroEngine checkpoints through ``torch.distributed.checkpoint`` (DCP): atomic, collective-safe,
reshardable, verified, and never running code from the files they read.

Layout, naming, checksums and retention are ``checkpoint_files.py`` (one ``ckpt-<step>-<nonce>``
folder per version, ``LATEST`` naming the newest, ``meta.json`` with ``"kind": "engine"``); the
collective save and load protocol is ``checkpoint_io.py``, the restricted reading of DCP files
``checkpoint_safe.py``. The torch trainers (``experiments/runner/trainers.py``) use the same three.

What is saved, per flat unit (``partition.UnitLayout``): the fp32 master and both Adam moments
as 1-D tensors of the unit's *unpadded* length. A sharded unit's are ``Shard(0)`` DTensors over a
1-D world ``DeviceMesh``: the engine pads a unit to ``W * S`` with ``S = ceil(numel / W)`` and gives
rank ``r`` the range ``[r*S, (r+1)*S)``, so rank ``r``'s shard minus the padding is exactly
``torch.chunk``'s piece ``r``, which is what ``Shard(0)`` holds (a rank past the end holds an
empty piece). A replicated unit's are plain tensors, written once (DCP de-duplicates them).
Frozen parameters (in their original dtype) and buffers are saved replicated as ``model.<name>``.
``meta.json`` holds the step count, the loss scaler, the unit layouts, the parameter dtypes, the
caller's ``extra`` values, the ``parent`` version and a CRC-32 of every other file of the folder.
Format-2 checkpoints (older versions, no checksum of ``.metadata``) still load.

Where the state lives during a save or load: every piece stays in its own tier and moves one at a
time. In-memory state (device, or the pinned host memory of ``offload_optimizer=cpu``) enters the
DCP state dict as views of the live tensors, a sharded unit's as a ``Shard(0)`` DTensor on a mesh
of the *tensor's* device type (``DeviceMesh.from_group`` over the same ranks, no new group: DCP
only reads a rank's coordinate from it), so host state is never moved to the GPU (``from_local``
would move it to a CUDA mesh's device). A save writes each piece from where it lives, or from a
host copy freed once written; a load copies each piece read from the file into the live tensor,
in place. State in a swap file (``offload_optimizer=nvme``) enters as placeholders: a save reads
each piece from the file as DCP writes it, a load writes each piece to the file as DCP reads it
(``checkpoint_stream.py``). So the transient host memory of a save is about one piece (one state of
one unit), that of a load about three (the file's chunk, its decoded tensor, the buffer for the
swap file), whatever the tier and the state's size. A checkpoint loads into any tier.

Tensor parallelism (``topology.tp > 1``): each tp index holds its own TP-local pieces of the split
weights, sharded over the data-parallel ranks that share that index, so every key is prefixed
``tp<t>.`` and the sharded units' DTensors live on the ``dp`` dimension of the engine's
``("dp", "tp")`` mesh; ``meta.json`` records ``tp`` and the split table
(``tensor_parallel.split_table``). Such a checkpoint loads at the same ``tp`` and any data-parallel
size; :func:`zeropp.runtime.consolidate.export_consolidated` merges the tp pieces into the unsplit model's weights.

Resharding: DCP reads, for every piece a loading rank needs, whatever saved pieces overlap it. So a
checkpoint loads at any world size and any stage, as long as the parameters are grouped into the
same units (same model, same ``persistence_threshold`` at stage 3, same ``coalesce_numel``);
otherwise the load is refused with the differing units named.

Exact resume of quantized runs: each rank's qgZ error-feedback residuals (``CheckpointTarget.feedback``,
a ``zeropp.comm.ErrorFeedback``, stored as they are kept: INT8 codes + scales, or fp32) are saved
under the rank's own keys ``feedback.rank<r>.<bucket>|<field>``, and every rank's stochastic-rounding
call counter (the engine's communication session's, ``zeropp.comm.stochastic``) in ``meta.json``. A load at the same world size, stage and
topology restores both, so a resumed run draws the same noise and carries the same residuals as an
uninterrupted one. Residuals are laid out per rank and per topology, so a load that reshards
(another world size, stage or topology) drops them with a warning (they restart from zero, as at
the start of a run); the counter is restored whenever the saving ranks agreed on it, else left as
it is, with a warning.

Atomic commit: a save writes a fresh version directory, waits for every rank, and only then
rank 0 replaces ``LATEST`` (temporary file + ``os.replace``). A failure anywhere before that leaves
``LATEST`` naming the previous complete checkpoint and removes the new folder. After the commit,
the run's versions past the newest ``keep`` are removed (``checkpoint_files.retire``). A save
whose values hold NaN or inf (a diverged run) is refused before anything is written.

Collective safety: each rank does its local part inside ``try`` and all ranks agree with one small
all-reduce (on the engine's device) before any step that could block; DCP itself reports a failure
during its collective phases to every rank. Either way *every* rank raises
:class:`CheckpointError` naming the failing rank(s), and a failed save never moves ``LATEST``.
A load checks everything it can first (layouts, checksums, the metadata): a failure there changes
nothing. A failure while DCP reads the data (a file that vanished or cannot be read mid-load) may
have replaced part of the optimizer state, since it loads in place: the ranks agree on whether any
of them received data and, if so, the error says so and the optimizer refuses to train, save or
export (``StateGuard.invalidate``) until a load succeeds; a mix of two states is never used.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from zeropp.comm import stochastic as sr

from . import checkpoint_io as cio
from . import checkpoint_stream as cs
from .checkpoint_files import FORMAT, commit, latest, read_meta
from .checkpoint_io import CheckpointError, Origin
from .checkpoint_safe import read_metadata, tensor_entry
from .loss_scale import LossScaler
from .optimizer import ShardedAdamW
from .partition import UnitLayout

if TYPE_CHECKING:
    from .offload import SwappedAdamW

__all__ = ["FORMAT", "CheckpointError", "CheckpointTarget", "Origin", "commit", "latest", "load", "read_meta", "save"]


@dataclass
class CheckpointTarget:
    """What a checkpoint reads from and writes into: the engine passes one per call."""

    layouts: Sequence[UnitLayout]
    """The engine's flat units, in the order of ``optimizer``'s lists."""
    optimizer: ShardedAdamW | SwappedAdamW
    """Holds this rank's master shards and Adam moments (padded ``[S]``, or ``[numel]`` if replicated),
    in memory or offloaded (``offload.SwappedAdamW`` has the same interface): read and written
    piece by piece through ``read_range`` / ``write_range`` (in place when ``in_memory``), sized by
    ``numels``; ``loaded`` / ``invalidate`` after a load."""
    scaler: LossScaler
    """The loss scaler whose state is saved and restored."""
    rank: int
    """This rank's index among the ranks the units are sharded over (the data-parallel ranks)."""
    world_size: int
    """How many ranks the units are sharded over (the default group's size unless ``tp > 1``)."""
    device: torch.device
    """Where the agreement flags travel (the process group's device)."""
    stage: int
    param_dtypes: dict[str, torch.dtype]
    """Parameter name -> dtype in the unwrapped model (for the consolidated export)."""
    model_state: dict[str, torch.Tensor] = field(default_factory=dict)
    """Replicated tensors saved besides the units: frozen parameters (original dtype), buffers."""
    info: dict[str, str] = field(default_factory=dict)
    """Free text recorded in meta.json (config, topology)."""
    feedback: Any = None
    """This rank's qgZ error-feedback residuals (``zeropp.comm.ErrorFeedback``: ``state_dict`` /
    ``load_state_dict`` / ``reset``) or None: saved per rank, restored at the same world size,
    stage and topology, else dropped with a warning."""
    tp: int = 1
    """Tensor-parallel degree; with ``tp > 1`` this rank's keys are prefixed ``tp<tp_rank>.``."""
    tp_rank: int = 0
    """This rank's tensor-parallel index (0 when ``tp == 1``)."""
    mesh: DeviceMesh | None = None
    """The 1-D mesh of the ``world_size`` ranks the units are sharded over (``tp > 1``: the ``dp``
    dimension of the model's ``("dp", "tp")`` mesh); None: one over the whole default group."""
    tp_split: dict[str, dict] = field(default_factory=dict)
    """``tp > 1``: ``tensor_parallel.split_table(model)``, saved for ``consolidate.export_consolidated``."""
    stochastic: sr.StochasticCounter = field(default_factory=lambda: sr.DEFAULT_COUNTER)
    """The stochastic-rounding call counter saved and restored (the engine's session's; the
    default session's when not given)."""

    def __post_init__(self) -> None:
        if self.tp > 1 and self.mesh is None:
            raise ValueError("CheckpointTarget: tp > 1 needs the data-parallel mesh (mesh=model's mesh['dp'])")

    @property
    def prefix(self) -> str:
        """Prefix of this rank's unit and model keys: ``tp<t>.`` with tensor parallelism, else empty."""
        return f"tp{self.tp_rank}." if self.tp > 1 else ""


@dataclass(frozen=True)
class _Piece:
    """This rank's piece of one state of one unit, as the checkpoint holds it."""

    key: str
    """The DCP key: ``[tp<t>.]units.<unit>.<state>``."""
    i: int
    """The unit's index in the optimizer's lists."""
    name: str
    """The state (one of ``ShardedAdamW.STATE``)."""
    layout: UnitLayout
    n: int
    """Elements of the piece: the unit's unpadded range of this rank (the whole unit if replicated);
    the optimizer's ``[S]`` holds it at ``[0, n)``, then padding."""


def _pieces(t: CheckpointTarget) -> list[_Piece]:
    out: list[_Piece] = []
    for i, lay in enumerate(t.layouts):
        a, b = (0, lay.numel) if lay.num_shards == 1 else lay.unpadded_range(t.rank)
        out.extend(_Piece(f"{t.prefix}units.{lay.name}.{name}", i, name, lay, b - a) for name in ShardedAdamW.STATE)
    return out


class _Meshes:
    """The 1-D mesh of the ``world_size`` ranks the units are sharded over, per device type.

    A ``Shard(0)`` DTensor must be on a mesh of its local tensor's own device type:
    ``DTensor.from_local`` moves a tensor to its mesh's device, so host-tier state on a CUDA mesh
    would go to the GPU whole. Each mesh is built from the existing group (``DeviceMesh.from_group``:
    no new process group, no collective), also for ``cpu`` on an NCCL group: DCP never communicates
    over a DTensor's mesh, it only reads the rank's coordinate to place the rank's piece (its own
    coordination uses the default group)."""

    def __init__(self, t: CheckpointTarget) -> None:
        self.given = t.mesh
        group = t.mesh.get_group() if t.mesh is not None else dist.group.WORLD
        assert group is not None, "a checkpoint is saved or loaded in an initialized process group"
        self.group = group
        self.meshes: dict[str, DeviceMesh] = {}

    def __call__(self, device_type: str) -> DeviceMesh:
        if self.given is not None and self.given.device_type == device_type:
            return self.given
        if device_type not in self.meshes:
            self.meshes[device_type] = DeviceMesh.from_group(self.group, device_type)
        return self.meshes[device_type]


def _unit_state(t: CheckpointTarget) -> tuple[dict[str, Any], list[_Piece]]:
    """The DCP state dict of the units and their pieces. In-memory state enters as views of the
    live tensors (no copy; a load fills them in place); state in a file as placeholders, whose data
    ``checkpoint_stream``'s planners move one piece at a time. Sharded units' become ``Shard(0)``
    DTensors on a mesh of their own device type, replicated units' stay plain tensors."""
    opt, meshes, sd = t.optimizer, _Meshes(t), {}
    pieces = _pieces(t)
    for p in pieces:
        local = opt.read_range(p.name, p.i, 0, p.n) if opt.in_memory else cs.placeholder(p.n)  # [n]
        if p.layout.num_shards > 1:
            local = DTensor.from_local(
                local,
                meshes(local.device.type),
                [Shard(0)],
                run_check=False,
                shape=torch.Size([p.layout.numel]),
                stride=(1,),
            )
        sd[p.key] = local
    return sd, pieces


def save(
    t: CheckpointTarget,
    path: str | os.PathLike,
    extra: dict | None = None,
    *,
    keep: int = 2,
    origin: Origin | None = None,
) -> Origin:
    """Collective. Saves a new version under ``path``, named by the training step it holds
    (``extra["step"]`` when given, else the optimizer's step count), and keeps this run's ``keep``
    newest versions (``origin``: the version this state was last saved to or loaded from; None
    for a fresh run). Returns the new version. On any rank's failure every rank raises
    :class:`CheckpointError`; ``LATEST`` and the older versions are as they were."""
    me = dist.get_rank()
    step = (extra or {}).get("step", t.optimizer.step_count)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint extra['step']={step!r}: the training step must be an int >= 0")

    def prepare() -> cio.Prepared:
        meta = {
            "world_size": t.world_size,
            "stage": t.stage,
            "step": t.optimizer.step_count,
            "scaler": t.scaler.state_dict(),
            "units": [lay.to_dict() for lay in t.layouts],
            "param_dtypes": {k: str(v).removeprefix("torch.") for k, v in t.param_dtypes.items()},
            "model_state": {k: str(v.dtype).removeprefix("torch.") for k, v in t.model_state.items()},
            "extra": extra if extra is not None else {},
            **t.info,
        }
        if t.tp > 1:
            meta.update(tp=t.tp, tp_split=t.tp_split)
        opt = t.optimizer
        opt.check_valid()  # a failed load's mix of two states is never saved
        sd, pieces = _unit_state(t)
        sources: dict[str, Callable[[], torch.Tensor]] = (
            {} if opt.in_memory else {p.key: partial(opt.read_range, p.name, p.i, 0, p.n) for p in pieces}
        )
        sd.update({f"{t.prefix}model.{k}": v for k, v in t.model_state.items()})
        if t.feedback is not None:
            sd.update({f"{_feedback_prefix(me)}{k}": v for k, v in t.feedback.state_dict().items()})
        return cio.Prepared(state=sd, meta=meta, rank_meta={"stochastic_calls": t.stochastic.value}, sources=sources)

    return cio.save_version(path, step=step, kind="engine", prepare=prepare, keep=keep, origin=origin, device=t.device)


def _check(t: CheckpointTarget, path: str | os.PathLike) -> tuple[Path, dict]:
    """This rank's part of a load: find the version, verify the files this rank is responsible
    for and read the DCP metadata safely (``checkpoint_io.locate``), check it fits. No collective,
    no state change."""
    d, meta = cio.locate(path, "engine")
    if meta.get("tp", 1) != t.tp:
        raise ValueError(
            f"{d} was saved with topology.tp={meta.get('tp', 1)} and this run has tp={t.tp}: a "
            f"tensor-parallel checkpoint loads at the same tp (any data-parallel size). Load it with "
            f"tp={meta.get('tp', 1)}, or export_consolidated() it to full weights"
        )
    saved = {u["name"]: UnitLayout.from_dict(u) for u in meta["units"]}
    mine = {lay.name: lay for lay in t.layouts}
    if set(saved) != set(mine):
        raise ValueError(
            f"{d} has units {sorted(saved)} but this engine has {sorted(mine)}: parameter partitioning differs "
            f"(different model; stage 3's persistence_threshold moved parameters into or out of the "
            f"'persistent' unit; or ZeroConfig.coalesce_numel (the runner's zero.coalesce_numel) groups the "
            f"blocks differently: 'block<i>-<j>' units are blocks i..j coalesced). Use the same model, "
            f"persistence_threshold and coalesce_numel as the saving run, or export_consolidated()"
        )
    for name, lay in mine.items():
        if saved[name].params() != lay.params():
            raise ValueError(
                f"{d}: unit {name!r} holds {saved[name].params()} in the checkpoint but "
                f"{lay.params()} here: parameter partitioning differs (a different model)"
            )
    if sorted(meta["model_state"]) != sorted(t.model_state):
        raise ValueError(
            f"{d}: frozen parameters / buffers {sorted(meta['model_state'])} were saved, this model has "
            f"{sorted(t.model_state)}; freeze the same parameters as the saving run"
        )
    return d, meta


@torch.no_grad()
def load(t: CheckpointTarget, path: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor], Origin]:
    """Collective. Loads the latest checkpoint under ``path`` into ``t.optimizer`` and ``t.scaler``
    (any world size or stage saved it) and returns ``(extra, model_state, origin)``: the values the
    saver passed, the loaded frozen parameters / buffers for the engine to put back, and the version
    loaded (the ``origin`` of the next save). Every file is verified against its checksum and no
    code in the checkpoint runs. On any rank's failure every rank raises :class:`CheckpointError`
    naming it; nothing has changed unless the error says the optimizer state was partly replaced
    (a read that failed mid-way: the optimizer then refuses to be used until a load succeeds)."""
    error, token, d, meta, feedback = None, 0, None, None, None
    try:
        d, meta = _check(t, path)
        token = Origin.of(d).token
        feedback = _feedback_tensors(t, d, meta)  # this rank's saved residuals, or None to drop them
    except Exception as exc:
        error = cio.describe(exc)
    hint = "No rank's state was changed. Restore or re-create the checkpoint, or load one saved from the same model"
    cio.agree(t.device, error, f"load from {path}", hint, token)
    assert d is not None and meta is not None
    opt = t.optimizer
    sd, pieces = _unit_state(t)
    sinks = {} if opt.in_memory else {p.key: partial(opt.write_range, p.name, p.i) for p in pieces}
    model_state = {k: torch.empty_like(v) for k, v in t.model_state.items()}
    sd.update({f"{t.prefix}model.{k}": v for k, v in model_state.items()})
    sd.update(feedback or {})
    planner = cs.InPlaceLoadPlanner(sinks, live=[p.key for p in pieces])
    what = f"load from {path}"

    def torn(ranks: list[int]) -> str:
        """Mark the optimizer unusable (the state of ``ranks`` was partly replaced); the error's hint."""
        opt.invalidate(
            f"the checkpoint load from {path} failed after it had replaced part of the optimizer state "
            f"of rank(s) {ranks}: this engine holds a mix of two states and refuses to train, save or "
            f"export until a load succeeds. Fix the cause and load a checkpoint again"
        )
        return (
            f"The optimizer state of rank(s) {ranks} was partly replaced: this engine refuses to train, save or "
            f"export until a load succeeds. Fix the cause and load this checkpoint again, or an older one"
        )

    try:
        cio.read_state(sd, d, meta, what=what, hint=hint, planner=planner)
    except CheckpointError as exc:  # raised on every rank: agree on whether a rank's state was written
        written = cio.ranks_where(t.device, planner.touched)
        if not written:
            raise
        cio.raise_failures(exc.failures, dist.get_world_size(), what, torn(written))
    error = None
    try:
        for p in pieces:  # the padding of a shard stays zero, whatever the engine held before
            pad = opt.numels[p.i] - p.n
            if pad:
                opt.write_range(p.name, p.i, p.n, torch.zeros(pad, dtype=torch.float32))
        if t.feedback is not None:  # validates everything before it changes anything
            if feedback:
                n = len(_feedback_prefix(dist.get_rank()))
                t.feedback.load_state_dict({k[n:]: v for k, v in feedback.items()})
            else:
                t.feedback.reset()
    except Exception as exc:
        error = cio.describe(exc)
    try:
        cio.agree(t.device, error, what, "")
    except CheckpointError as exc:
        cio.raise_failures(exc.failures, dist.get_world_size(), what, torn(list(range(dist.get_world_size()))))
    opt.loaded(step=int(meta["step"]))
    t.scaler.load_state_dict(meta["scaler"])
    _restore_stochastic_calls(t, meta)
    return dict(meta.get("extra") or {}), model_state, Origin.of(d)


def _feedback_prefix(rank: int) -> str:
    """Keys of global rank ``rank``'s error-feedback residuals."""
    return f"feedback.rank{rank}."


def _feedback_tensors(t: CheckpointTarget, d: Path, meta: dict) -> dict[str, torch.Tensor] | None:
    """Empty tensors for this rank's saved error-feedback entries (from the DCP metadata), or
    None when there are none to restore: no feedback here, none saved, or a load that reshards
    (a warning says what is dropped). Local: no collective."""
    if t.feedback is None:
        return None
    md = read_metadata(d, cio.data_files(meta)).state_dict_metadata
    saved = [k for k in md if k.startswith("feedback.rank")]
    if not saved:
        return None
    here = {"world_size": t.world_size, "stage": t.stage, "topology": t.info.get("topology")}
    there = {k: meta.get(k) for k in here}
    if here != there:
        if dist.get_rank() == 0:
            warnings.warn(
                f"checkpoint {d.name}: dropping the error-feedback residuals, saved per rank at {there} and "
                f"loaded at {here}; they restart from zero (the run is not an exact continuation)",
                stacklevel=3,
            )
        return None
    prefix = _feedback_prefix(dist.get_rank())
    return {
        k: torch.empty(tensor_entry(md, k).size, dtype=tensor_entry(md, k).properties.dtype, device=t.device)
        for k in saved
        if k.startswith(prefix)
    }


def _restore_stochastic_calls(t: CheckpointTarget, meta: dict) -> None:
    """Set the target's stochastic-rounding call counter to the value the saving run had: the
    same rank's at the same world size, else the value all saving ranks shared."""
    calls = meta.get("stochastic_calls")
    if not calls:
        return  # saved before counters were recorded
    me, world = dist.get_rank(), dist.get_world_size()
    if len(calls) == world:
        t.stochastic.reset(int(calls[me]))
    elif len(set(calls)) == 1:
        t.stochastic.reset(int(calls[0]))
    elif me == 0:
        warnings.warn(
            f"checkpoint: the {len(calls)} saving ranks had different stochastic-rounding call counters "
            f"{calls}; loading at world size {world}, the counter is left at "
            f"{t.stochastic.value}",
            stacklevel=3,
        )
