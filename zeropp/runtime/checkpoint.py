"""Sharded checkpoints with atomic commit, and consolidation into a plain ``state_dict``.

Layout under the checkpoint directory ``path``::

    path/LATEST                  name of the newest *complete* checkpoint (one line)
    path/ckpt-<step>-<nonce>/    rank00000.pt ... rank{W-1}.pt, meta.json

A save writes a fresh version directory (each rank its own file, via a temporary name and
``os.replace``), waits for every rank, and only then rank 0 replaces ``LATEST`` (again temp file +
``os.replace``, which is atomic on POSIX). A crash anywhere before that leaves ``LATEST`` naming
the previous complete checkpoint; half-written directories are removed by the next successful
save. Loading reads ``LATEST`` only, so it can never see a partial save.

Each rank file holds that rank's fp32 master shards and Adam moments, the step count, the fp16
loss-scaler state and the unit layout, which is checked on load (same world size, stage and
partitioning). qgZ error-feedback residuals are not saved: a load resets them to zero.

Both ``save`` and ``load`` are collective-safe: each rank does its local part (writing its shard;
reading and checking its file) inside ``try``, then all ranks agree with one small all-reduce.
If any rank failed, *every* rank raises :class:`CheckpointError` naming the failing rank(s) and
their reasons (gathered with ``all_gather_object`` only on that path), instead of the healthy
ranks hanging at the next barrier or collective. A failed save never moves ``LATEST``, so the
previous checkpoint stays loadable; a failed load leaves the engine's state untouched. A load
also checks that every rank read the same checkpoint version.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .engine import ZeroEngine

FORMAT = 1


class CheckpointError(RuntimeError):
    """A checkpoint save or load failed on at least one rank; raised identically on every rank."""

    def __init__(self, message: str, failures: dict[int, str]) -> None:
        super().__init__(message)
        self.failures = failures
        """Failing global rank -> its error (``"Type: message"``)."""


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _agree(e: "ZeroEngine", error: str | None, what: str, hint: str, token: int = 0) -> None:
    """Collective: raise :class:`CheckpointError` on every rank if ``error`` is set on any rank,
    or if the ranks' ``token`` values differ. One 3-element all-reduce when all is well."""
    flag = torch.tensor([1 if error else 0, token, -token], dtype=torch.int64, device=e.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    failed, hi, lo = (int(x) for x in flag.tolist())
    if failed:
        msgs: list = [None] * e.world_size
        dist.all_gather_object(msgs, error)
        failures = {r: m for r, m in enumerate(msgs) if m}
        by_msg: dict[str, list[int]] = {}
        for r, m in failures.items():
            by_msg.setdefault(m, []).append(r)
        lines = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {rs if len(rs) > 1 else rs[0]}: {m}" for m, rs in by_msg.items())
        raise CheckpointError(f"checkpoint {what} failed on rank(s) {sorted(failures)} of {e.world_size}: {lines}. "
                              f"{hint}", failures)
    if hi != -lo:
        raise CheckpointError(f"checkpoint {what} failed: the ranks read different checkpoint versions (LATEST "
                              f"changed during the load, or the ranks do not see the same directory). Make every "
                              f"rank load the same path, with no save running at the same time", {})


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(target: Path, write) -> None:
    """``write(tmp_path)`` then rename over ``target``: readers see the old file or the new one."""
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    write(tmp)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, target)
    _fsync_dir(target.parent)


def _rank_state(e: "ZeroEngine") -> dict:
    return {
        "format": FORMAT, "world_size": e.world_size, "stage": e.cfg.stage, "rank": e.rank,
        "units": [{"name": u.name, "kind": u.kind, "padded": u.padded, "layout": u.layout()} for u in e.units],
        "optim": e.optim.state(), "loss_scale": e._loss_scale, "good_steps": e._good_steps,
    }


def _commit(root: Path, tag: str) -> None:
    """Point LATEST at ``tag`` (the single atomic step that makes a checkpoint visible)."""
    _write_atomic(root / "LATEST", lambda p: p.write_text(tag + "\n"))


def save(e: "ZeroEngine", path: str | os.PathLike) -> str:
    """Collective. Returns the version directory written. On any rank's failure every rank raises
    :class:`CheckpointError` and ``LATEST`` still names the previous complete checkpoint."""
    root = Path(path)
    obj = [f"ckpt-{e.optim.step_count:08d}-{time.time_ns():x}" if e.rank == 0 else None]
    dist.broadcast_object_list(obj, src=0)
    tag = obj[0]
    d = root / tag
    error = None
    try:
        d.mkdir(parents=True, exist_ok=True)
        state = _rank_state(e)
        _write_atomic(d / f"rank{e.rank:05d}.pt", lambda p: torch.save(state, p))
        if e.rank == 0:
            meta = {"format": FORMAT, "world_size": e.world_size, "stage": e.cfg.stage, "step": e.optim.step_count,
                    "config": repr(e.cfg), "topology": repr(e.topology)}
            _write_atomic(d / "meta.json", lambda p: p.write_text(json.dumps(meta, indent=1)))
    except Exception as exc:  # noqa: BLE001 - reported to every rank by _agree
        error = f"writing {d}: {_describe(exc)}"
    hint = (f"Nothing was committed: {root / 'LATEST'} still names the previous checkpoint. Fix the cause "
            f"(disk space, permissions, path reachable from every rank) and save again")
    _agree(e, error, "save", hint)  # every shard is on disk before anyone can commit
    error = None
    if e.rank == 0:
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
    _agree(e, error, "save", hint)
    return str(d)


def latest(path: str | os.PathLike) -> Path:
    root = Path(path)
    f = root / "LATEST"
    if not f.is_file():
        raise FileNotFoundError(f"no complete checkpoint under {root} (missing {f})")
    d = root / f.read_text().strip()
    if not d.is_dir():
        raise FileNotFoundError(f"{f} names {d.name}, which does not exist")
    return d


def _read_checked(e: "ZeroEngine", path: str | os.PathLike) -> tuple[Path, dict]:
    """This rank's part of a load: find, read and check its file (no collective, no state change)."""
    d = latest(path)
    f = d / f"rank{e.rank:05d}.pt"
    if not f.is_file():
        raise FileNotFoundError(f"{f} is missing (saved by a different world size, or the file was removed)")
    try:
        state = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises several types for a damaged file
        raise ValueError(f"{f} cannot be read ({_describe(exc)}): the file is corrupt or truncated") from exc
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        fmt = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{f}: checkpoint format {fmt} is not {FORMAT}")
    if state["world_size"] != e.world_size or state["stage"] != e.cfg.stage:
        raise ValueError(
            f"{d} was saved by stage {state['stage']} on {state['world_size']} ranks; this engine is stage "
            f"{e.cfg.stage} on {e.world_size}. Load it with the same stage and world size, or export "
            f"consolidated_state_dict() and wrap a model built from that")
    if state.get("rank") != e.rank:
        raise ValueError(f"{f} holds rank {state.get('rank')}'s shard, not rank {e.rank}'s: the files were renamed")
    mine = [{"name": u.name, "kind": u.kind, "padded": u.padded, "layout": [tuple(x) for x in u.layout()]} for u in e.units]
    theirs = [{**x, "layout": [(n, tuple(s)) for n, s in x["layout"]]} for x in state["units"]]
    if mine != theirs:
        raise ValueError(f"{d}: parameter partitioning differs from this engine's (different model or persistence_threshold)")
    for name in ("masters", "exp_avg", "exp_avg_sq"):
        ours, saved = getattr(e.optim, name), state["optim"][name]
        if len(ours) != len(saved) or any(a.shape != b.shape for a, b in zip(ours, saved)):
            raise ValueError(f"{f}: optimizer state {name!r} does not match this engine's partitioning")
    return d, state


@torch.no_grad()
def load(e: "ZeroEngine", path: str | os.PathLike) -> None:
    """Collective. On any rank's failure every rank raises :class:`CheckpointError` naming it,
    and no rank's state has changed."""
    error, token, d, state = None, 0, None, None
    try:
        d, state = _read_checked(e, path)
        token = zlib.crc32(d.name.encode()) + 1
    except Exception as exc:  # noqa: BLE001 - reported to every rank by _agree
        error = _describe(exc)
    _agree(e, error, f"load from {path}", "No rank's state was changed. Restore or re-create the checkpoint, or "
           "load one saved with this world size, stage and model", token)
    e.optim.load_state(state["optim"])
    e._loss_scale, e._good_steps = float(state["loss_scale"]), int(state["good_steps"])
    if e._ef is not None:
        e._ef.reset()  # residuals belong to the run that produced them
    for u in e.units:
        u.secondary = None  # stale: built from the weights before the load
        if u.grad_shard is not None:
            u.grad_shard.zero_()
    e.refresh_params()


@torch.no_grad()
def consolidated_state_dict(e: "ZeroEngine") -> dict[str, torch.Tensor]:
    """Gather every unit's fp32 master and split it into the unwrapped model's parameters."""
    full_params: dict[str, torch.Tensor] = {}
    for u, m in zip(e.units, e.optim.masters):
        if u.kind == "replicated":
            full = m
        else:
            full = torch.empty(u.padded, dtype=torch.float32, device=m.device)
            e.comm.all_gather(full, m, bucket=e.cfg.allgather_bucket_size, kind="checkpoint", async_op=False)
        for name, t in u.unflatten(full).items():
            full_params[name] = t.to(dtype=e._param_dtypes[name], device="cpu").clone()
    out: dict[str, torch.Tensor] = {}
    for k, v in e.model.state_dict(keep_vars=True).items():
        if k in full_params:
            out[k] = full_params[k]
        elif k in e._frozen:  # a frozen parameter in its original dtype, not the compute-dtype copy
            out[k] = e._frozen[k].detach().to("cpu").clone()
        else:
            out[k] = v.detach().clone()
    return out
