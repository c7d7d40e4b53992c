"""Checkpoints through ``torch.distributed.checkpoint`` (DCP): atomic, collective-safe, reshardable.

Layout under the checkpoint directory ``path``::

    path/LATEST                  name of the newest *complete* checkpoint (one line)
    path/ckpt-<step>-<nonce>/    DCP files (.metadata, __<rank>_0.distcp), meta.json

What is saved, per flat unit (``partition.UnitLayout``): the fp32 master and both Adam moments
as 1-D tensors of the unit's *unpadded* length. A sharded unit's are ``Shard(0)`` DTensors over a
1-D world ``DeviceMesh``: the engine pads a unit to ``W * S`` with ``S = ceil(numel / W)`` and gives
rank ``r`` the range ``[r*S, (r+1)*S)``, so rank ``r``'s shard minus the padding is exactly
``torch.chunk``'s piece ``r``, which is what ``Shard(0)`` holds (a rank past the end holds an
empty piece). A replicated unit's are plain tensors, written once (DCP de-duplicates them).
Frozen parameters (in their original dtype) and buffers are saved replicated as ``model.<name>``.
``meta.json`` holds the step count, the loss scaler, the unit layouts, the parameter dtypes, the
caller's ``extra`` values and a CRC-32 per DCP file.

Offloaded optimizer state (``offload.py``) is saved in the same format: the holder hands each
state back as a host tensor (``state_tensor``; read back from the swap file for the nvme tier, so a
save materializes the rank's optimizer state in host memory for the duration of the save) and a
load writes it back through ``load_state``. A checkpoint therefore loads into any offload tier.

Tensor parallelism (``topology.tp > 1``): each tp index holds its own TP-local pieces of the split
weights, sharded over the data-parallel ranks that share that index, so every key is prefixed
``tp<t>.`` and the sharded units' DTensors live on the ``dp`` dimension of the engine's
``("dp", "tp")`` mesh; ``meta.json`` records ``tp`` and the split table
(``tensor_parallel.split_table``). Such a checkpoint loads at the same ``tp`` and any data-parallel
size; :func:`zeropp.runtime.consolidate.export_consolidated` merges the tp pieces into the unsplit model's weights.

Resharding: DCP reads, for every piece a loading rank needs, whatever saved pieces overlap it. So a
checkpoint loads at any world size and any stage, as long as the parameters are grouped into the
same units (same model, same ``persistence_threshold`` at stage 3); otherwise the load is refused
with the differing unit named.

Exact resume of quantized runs: each rank's qgZ error-feedback residuals (``CheckpointTarget.feedback``,
a ``zeropp.comm.ErrorFeedback``, stored as they are kept: INT8 codes + scales, or fp32) are saved
under the rank's own keys ``feedback.rank<r>.<bucket>|<field>``, and every rank's stochastic-rounding
call counter (``zeropp.comm.stochastic``) in ``meta.json``. A load at the same world size, stage and
topology restores both, so a resumed run draws the same noise and carries the same residuals as an
uninterrupted one. Residuals are laid out per rank and per topology, so a load that reshards
(another world size, stage or topology) drops them with a warning (they restart from zero, as at
the start of a run); the counter is restored whenever the saving ranks agreed on it, else left as
it is, with a warning.

Atomic commit: a save writes a fresh version directory, waits for every rank, and only then
rank 0 replaces ``LATEST`` (temporary file + ``os.replace``). A crash anywhere before that leaves
``LATEST`` naming the previous complete checkpoint; debris is removed by the next successful save.

Collective safety: each rank does its local part inside ``try`` and all ranks agree with one small
all-reduce (on the engine's device) before any step that could block; DCP itself reports a failure
during its collective phases to every rank. Either way *every* rank raises
:class:`CheckpointError` naming the failing rank(s), a failed save never moves ``LATEST``, and a
failed load leaves the engine's state untouched (it loads into fresh tensors, copied in at the end).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from zeropp.comm import stochastic as sr

from .loss_scale import LossScaler
from .optimizer import ShardedAdamW
from .partition import UnitLayout

FORMAT = 2
_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


class CheckpointError(RuntimeError):
    """A checkpoint save or load failed on at least one rank; raised identically on every rank."""

    def __init__(self, message: str, failures: dict[int, str]) -> None:
        super().__init__(message)
        self.failures = failures
        """Failing global rank -> its error (``"Type: message"``)."""


@dataclass
class CheckpointTarget:
    """What a checkpoint reads from and writes into: the engine passes one per call."""

    layouts: Sequence[UnitLayout]
    """The engine's flat units, in the order of ``optimizer``'s lists."""
    optimizer: ShardedAdamW
    """Holds this rank's master shards and Adam moments (padded ``[S]``, or ``[numel]`` if replicated),
    in memory or offloaded (``offload.SwappedAdamW`` has the same interface): read through
    ``state_tensor(name, i)``, written through ``load_state``, sized by ``numels``."""
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

    def __post_init__(self) -> None:
        if self.tp > 1 and self.mesh is None:
            raise ValueError("CheckpointTarget: tp > 1 needs the data-parallel mesh (mesh=model's mesh['dp'])")

    @property
    def prefix(self) -> str:
        """Prefix of this rank's unit and model keys: ``tp<t>.`` with tensor parallelism, else empty."""
        return f"tp{self.tp_rank}." if self.tp > 1 else ""


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _raise_failures(failures: dict[int, str], world: int, what: str, hint: str) -> None:
    by_msg: dict[str, list[int]] = {}
    for r, m in sorted(failures.items()):
        by_msg.setdefault(m, []).append(r)
    lines = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {rs if len(rs) > 1 else rs[0]}: {m}" for m, rs in by_msg.items())
    raise CheckpointError(f"checkpoint {what} failed on rank(s) {sorted(failures)} of {world}: {lines}. {hint}", failures)


def _agree(t: CheckpointTarget, error: str | None, what: str, hint: str, token: int = 0) -> None:
    """Collective: raise :class:`CheckpointError` on every rank if ``error`` is set on any rank,
    or if the ranks' ``token`` values differ. One 3-element all-reduce when all is well."""
    flag = torch.tensor([1 if error else 0, token, -token], dtype=torch.int64, device=t.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    failed, hi, lo = (int(x) for x in flag.tolist())
    if failed:
        msgs: list = [None] * dist.get_world_size()
        dist.all_gather_object(msgs, error)
        _raise_failures({r: m for r, m in enumerate(msgs) if m}, len(msgs), what, hint)
    if hi != -lo:
        raise CheckpointError(f"checkpoint {what} failed: the ranks read different checkpoint versions (LATEST "
                              f"changed during the load, or the ranks do not see the same directory). Make every "
                              f"rank load the same path, with no save running at the same time", {})


def _dcp_failures(exc: CheckpointException) -> dict[int, str]:
    return {int(r): _describe(pair[0]) for r, pair in exc.failures.items()}


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(target: Path, text: str) -> None:
    """Write ``text`` to a temporary file and rename it over ``target``: readers see old or new."""
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
    _fsync_dir(target.parent)


def _commit(root: Path, tag: str) -> None:
    """Point LATEST at ``tag`` (the single atomic step that makes a checkpoint visible)."""
    _write_atomic(root / "LATEST", tag + "\n")


def commit(root: str | os.PathLike, tag: str) -> None:
    """Point ``root/LATEST`` at version directory ``tag``, atomically and durably: for other DCP
    checkpoints that follow this layout (the runner's FSDP2/DDP trainers). Rank 0 only."""
    _commit(Path(root), tag)


def _storage_writer(d: Path) -> FileSystemWriter:
    """The DCP writer of one version directory (one file per rank, fsynced)."""
    return FileSystemWriter(d, single_file_per_rank=True, sync_files=True, thread_count=1)


def _crc(f: Path) -> int:
    crc = 0
    with open(f, "rb") as fh:
        while chunk := fh.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def _mesh(t: CheckpointTarget) -> DeviceMesh:
    return t.mesh if t.mesh is not None else DeviceMesh(t.device.type, list(range(t.world_size)))


def _unit_tensors(t: CheckpointTarget, mesh: DeviceMesh, make: Callable[[int, int, str], torch.Tensor]
                  ) -> dict[str, Any]:
    """The DCP state dict of the units: ``make(i, length, name)`` gives the local tensor of unit
    ``i``'s state ``name`` (its unpadded local piece); sharded units become ``Shard(0)`` DTensors."""
    sd: dict[str, Any] = {}
    for i, lay in enumerate(t.layouts):
        for name in ShardedAdamW.STATE:
            key = f"{t.prefix}units.{lay.name}.{name}"
            if lay.num_shards == 1:
                sd[key] = make(i, lay.numel, name)
                continue
            a, b = lay.unpadded_range(t.rank)
            local = make(i, b - a, name)  # [b - a]
            sd[key] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                                shape=torch.Size([lay.numel]), stride=(1,))
    return sd


def save(t: CheckpointTarget, path: str | os.PathLike, extra: dict | None = None) -> str:
    """Collective. Returns the version directory written. On any rank's failure every rank raises
    :class:`CheckpointError` and ``LATEST`` still names the previous complete checkpoint."""
    root = Path(path)
    step = t.optimizer.step_count
    me, world = dist.get_rank(), dist.get_world_size()  # files, meta.json and LATEST are the default group's
    obj = [f"ckpt-{step:08d}-{time.time_ns():x}" if me == 0 else None]
    dist.broadcast_object_list(obj, src=0, device=t.device if t.device.type != "cpu" else None)
    tag = obj[0]
    d = root / tag
    hint = (f"Nothing was committed: {root / 'LATEST'} still names the previous checkpoint. Fix the cause "
            f"(disk space, permissions, path reachable from every rank) and save again")
    error, meta_text = None, ""
    try:
        d.mkdir(parents=True, exist_ok=True)
        meta = {"format": FORMAT, "world_size": t.world_size, "stage": t.stage, "step": step,
                "scaler": t.scaler.state_dict(), "units": [lay.to_dict() for lay in t.layouts],
                "param_dtypes": {k: str(v).removeprefix("torch.") for k, v in t.param_dtypes.items()},
                "model_state": {k: str(v.dtype).removeprefix("torch.") for k, v in t.model_state.items()},
                "extra": extra if extra is not None else {}, **t.info}
        if t.tp > 1:
            meta.update(tp=t.tp, tp_split=t.tp_split)
        meta_text = json.dumps(meta, indent=1)  # fails here, before anything is written, if extra is not JSON
        mesh = _mesh(t)
        opt = t.optimizer
        sd = _unit_tensors(t, mesh, lambda i, n, name: opt.state_tensor(name, i)[:n])  # read back if offloaded
        sd.update({f"{t.prefix}model.{k}": v for k, v in t.model_state.items()})
        if t.feedback is not None:
            sd.update({f"{_feedback_prefix(me)}{k}": v for k, v in t.feedback.state_dict().items()})
    except Exception as exc:  # noqa: BLE001 - reported to every rank by _agree
        error = f"preparing {d}: {_describe(exc)}"
    _agree(t, error, "save", hint)
    try:
        dcp.save(sd, storage_writer=_storage_writer(d))
    except CheckpointException as exc:  # DCP told every rank who failed
        _raise_failures(_dcp_failures(exc), world, "save", hint)
    error = None
    crcs: list = [None] * world
    try:
        mine = {f.name: _crc(f) for f in d.iterdir() if (m := _FILE.match(f.name)) and int(m.group(1)) == me}
    except Exception as exc:  # noqa: BLE001
        mine, error = {}, f"checksumming {d}: {_describe(exc)}"
    dist.all_gather_object(crcs, (mine, sr.stochastic_calls()))
    if me == 0 and error is None:
        try:
            meta = json.loads(meta_text)
            meta["files"] = {k: v for c, _ in crcs for k, v in c.items()}
            meta["stochastic_calls"] = [calls for _, calls in crcs]  # per rank
            _write_atomic(d / "meta.json", json.dumps(meta, indent=1))
        except Exception as exc:  # noqa: BLE001
            error = f"writing {d / 'meta.json'}: {_describe(exc)}"
    _agree(t, error, "save", hint)  # every file is on disk before anyone can commit
    error = None
    if me == 0:
        try:
            _commit(root, tag)
        except Exception as exc:  # noqa: BLE001
            error = f"committing {root / 'LATEST'} -> {tag}: {_describe(exc)}"
        else:
            try:
                for old in root.glob("ckpt-*"):  # previous versions and debris of crashed saves
                    if old.name != tag:
                        shutil.rmtree(old, ignore_errors=True)
            except OSError:
                pass  # leftovers are harmless; the next successful save retries
    _agree(t, error, "save", hint)
    return str(d)


def latest(path: str | os.PathLike) -> Path:
    """The version directory ``LATEST`` names under ``path``."""
    root = Path(path)
    f = root / "LATEST"
    if not f.is_file():
        raise FileNotFoundError(f"no complete checkpoint under {root} (missing {f})")
    d = root / f.read_text().strip()
    if not d.is_dir():
        raise FileNotFoundError(f"{f} names {d.name}, which does not exist")
    return d


def read_meta(d: Path) -> dict:
    """The ``meta.json`` of version directory ``d``, checked for this format."""
    f = d / "meta.json"
    if not f.is_file():
        raise FileNotFoundError(f"{f} is missing (not a complete checkpoint of this format)")
    try:
        meta = json.loads(f.read_text())
    except ValueError as exc:
        raise ValueError(f"{f} cannot be read ({_describe(exc)}): the file is corrupt or truncated") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        fmt = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{f}: checkpoint format {fmt} is not {FORMAT}; re-save it with this version")
    return meta


def _check(t: CheckpointTarget, path: str | os.PathLike) -> tuple[Path, dict]:
    """This rank's part of a load: find the version, check it fits, verify the files this rank is
    responsible for (``__<i>_*.distcp`` with ``i % world == rank``). No collective, no state change."""
    d = latest(path)
    meta = read_meta(d)
    if meta.get("tp", 1) != t.tp:
        raise ValueError(f"{d} was saved with topology.tp={meta.get('tp', 1)} and this run has tp={t.tp}: a "
                         f"tensor-parallel checkpoint loads at the same tp (any data-parallel size). Load it with "
                         f"tp={meta.get('tp', 1)}, or export_consolidated() it to full weights")
    saved = {u["name"]: UnitLayout.from_dict(u) for u in meta["units"]}
    mine = {lay.name: lay for lay in t.layouts}
    if set(saved) != set(mine):
        raise ValueError(
            f"{d} has units {sorted(saved)} but this engine has {sorted(mine)}: parameter partitioning differs "
            f"(different model, or stage 3's persistence_threshold moved parameters into or out of the "
            f"'persistent' unit). Use the same model and persistence_threshold, or export_consolidated()")
    for name, lay in mine.items():
        if saved[name].params() != lay.params():
            raise ValueError(f"{d}: unit {name!r} holds {saved[name].params()} in the checkpoint but "
                             f"{lay.params()} here: parameter partitioning differs (a different model)")
    if sorted(meta["model_state"]) != sorted(t.model_state):
        raise ValueError(f"{d}: frozen parameters / buffers {sorted(meta['model_state'])} were saved, this model has "
                         f"{sorted(t.model_state)}; freeze the same parameters as the saving run")
    me, world = dist.get_rank(), dist.get_world_size()
    for fname, crc in sorted(meta["files"].items()):
        m = _FILE.match(fname)
        if m is None or int(m.group(1)) % world != me:
            continue
        f = d / fname
        if not f.is_file():
            raise FileNotFoundError(f"{f} is missing (removed after the save, or not visible from this rank)")
        if _crc(f) != crc:
            raise ValueError(f"{f} fails its checksum: the file is corrupt or truncated")
    return d, meta


@torch.no_grad()
def load(t: CheckpointTarget, path: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """Collective. Loads the latest checkpoint under ``path`` into ``t.optimizer`` and ``t.scaler``
    (any world size or stage saved it) and returns ``(extra, model_state)``: the values the saver
    passed and the loaded frozen parameters / buffers, for the engine to put back. On any rank's
    failure every rank raises :class:`CheckpointError` naming it, and nothing has changed."""
    error, token, d, meta, feedback = None, 0, None, None, None
    try:
        d, meta = _check(t, path)
        token = zlib.crc32(d.name.encode()) + 1
        feedback = _feedback_tensors(t, d, meta)  # this rank's saved residuals, or None to drop them
    except Exception as exc:  # noqa: BLE001 - reported to every rank by _agree
        error = _describe(exc)
    hint = ("No rank's state was changed. Restore or re-create the checkpoint, or load one saved from the same "
            "model")
    _agree(t, error, f"load from {path}", hint, token)
    assert d is not None and meta is not None
    mesh = _mesh(t)
    fresh: dict[tuple[int, str], torch.Tensor] = {}

    def make(i: int, n: int, name: str) -> torch.Tensor:
        fresh[(i, name)] = torch.zeros(n, dtype=torch.float32, device=t.device)
        return fresh[(i, name)]

    sd = _unit_tensors(t, mesh, make)
    model_state = {k: torch.empty_like(v) for k, v in t.model_state.items()}
    sd.update({f"{t.prefix}model.{k}": v for k, v in model_state.items()})
    sd.update(feedback or {})
    try:
        dcp.load(sd, storage_reader=FileSystemReader(d))
    except CheckpointException as exc:
        _raise_failures(_dcp_failures(exc), dist.get_world_size(), f"load from {path}", hint)
    opt = t.optimizer

    def piece_device(i: int, name: str) -> torch.device:
        return fresh[(i, name)].device

    state: dict[str, list[torch.Tensor]] = {}
    for name in ShardedAdamW.STATE:
        state[name] = []
        for i, numel in enumerate(opt.numels):
            full = torch.zeros(numel, dtype=torch.float32, device=piece_device(i, name))  # padded [S]: padding stays zero
            piece = fresh[(i, name)]
            full[: piece.numel()].copy_(piece)
            state[name].append(full)
    if t.feedback is not None:  # first: its load validates everything before it changes anything
        if feedback:
            n = len(_feedback_prefix(dist.get_rank()))
            t.feedback.load_state_dict({k[n:]: v for k, v in feedback.items()})
        else:
            t.feedback.reset()
    opt.load_state(state, step=int(meta["step"]))
    t.scaler.load_state_dict(meta["scaler"])
    _restore_stochastic_calls(t, meta)
    return dict(meta.get("extra") or {}), model_state


def _feedback_prefix(rank: int) -> str:
    """Keys of global rank ``rank``'s error-feedback residuals."""
    return f"feedback.rank{rank}."


def _feedback_tensors(t: CheckpointTarget, d: Path, meta: dict) -> dict[str, torch.Tensor] | None:
    """Empty tensors for this rank's saved error-feedback entries (from the DCP metadata), or
    None when there are none to restore: no feedback here, none saved, or a load that reshards
    (a warning says what is dropped). Local: no collective."""
    if t.feedback is None:
        return None
    md = FileSystemReader(d).read_metadata().state_dict_metadata
    saved = [k for k in md if k.startswith("feedback.rank")]
    if not saved:
        return None
    here = {"world_size": t.world_size, "stage": t.stage, "topology": t.info.get("topology")}
    there = {k: meta.get(k) for k in here}
    if here != there:
        if dist.get_rank() == 0:
            warnings.warn(f"checkpoint {d.name}: dropping the error-feedback residuals, saved per rank at {there} and "
                          f"loaded at {here}; they restart from zero (the run is not an exact continuation)",
                          stacklevel=3)
        return None
    prefix = _feedback_prefix(dist.get_rank())
    return {k: torch.empty(md[k].size, dtype=md[k].properties.dtype, device=t.device)
            for k in saved if k.startswith(prefix)}


def _restore_stochastic_calls(t: CheckpointTarget, meta: dict) -> None:
    """Set this process's stochastic-rounding call counter to the value the saving run had: the
    same rank's at the same world size, else the value all saving ranks shared."""
    calls = meta.get("stochastic_calls")
    if not calls:
        return  # saved before counters were recorded
    me, world = dist.get_rank(), dist.get_world_size()
    if len(calls) == world:
        sr.reset_stochastic_calls(int(calls[me]))
    elif len(set(calls)) == 1:
        sr.reset_stochastic_calls(int(calls[0]))
    elif me == 0:
        warnings.warn(f"checkpoint: the {len(calls)} saving ranks had different stochastic-rounding call counters "
                      f"{calls}; loading at world size {world}, the counter is left at "
                      f"{sr.stochastic_calls()}", stacklevel=3)
