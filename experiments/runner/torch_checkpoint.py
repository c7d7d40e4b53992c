"""Checkpoints of the torch trainers (FSDP2, DDP) in the engine's versioned, checksummed format.

``torch.distributed.checkpoint`` writes the sharded state; ``zeropp.runtime.checkpoint_io`` gives
it the same guarantees as ZeroEngine's checkpoints: a version directory per save, every file
checksummed, ``LATEST`` moved only after every rank has written, every rank agreeing on a failure.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def save_dcp(
    state: dict[str, Any],
    path: Path,
    extra: dict[str, Any],
    per_rank: dict[str, Any] | None = None,
    *,
    keep: int = 2,
    origin: Any = None,
    device: torch.device | None = None,
) -> Any:
    """Collective: ``state`` (a DCP state dict) as a new ``path/ckpt-<step>-<nonce>`` version in the
    engine's format (``zeropp.runtime.checkpoint_io``, ``"kind": "torch"``): every file checksummed,
    ``LATEST`` moved only after every rank has written, NaN/inf values refused, this run's ``keep``
    newest versions kept (``origin``: the version this state continues, None for a fresh run).
    ``per_rank``: this rank's own state (``rank-<r>.pt``: residuals and counters that are neither
    sharded nor replicated, so DCP has no place for them). Returns the new version (an ``Origin``)."""
    from zeropp.runtime import checkpoint_io as cio

    step = extra.get("step", 0)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint extra['step']={step!r}: the training step must be an int >= 0")

    def prepare() -> cio.Prepared:
        return cio.Prepared(
            state=state, meta={"step": step, "world_size": dist.get_world_size(), "extra": extra}, rank_state=per_rank
        )

    return cio.save_version(
        path,
        step=step,
        kind="torch",
        prepare=prepare,
        keep=keep,
        origin=origin,
        device=device if device is not None else torch.device("cpu"),
    )


def load_dcp(
    state: dict[str, Any], path: Path, *, device: torch.device | None = None
) -> tuple[dict[str, Any], dict[str, Any] | None, Any]:
    """Collective: load the checkpoint ``path/LATEST`` names into ``state`` in place, after every
    rank has verified its share of the files' checksums; nothing in the files can run code.
    Returns its extra, this rank's own state (None when the checkpoint has none for this rank) and
    the version loaded (an ``Origin``, for the next save). Failures raise ``CheckpointError`` on
    every rank, before ``state`` is touched when the files are at fault."""
    from zeropp.runtime import checkpoint_io as cio

    dev = device if device is not None else torch.device("cpu")
    error, token, d, meta = None, 0, None, None
    try:
        d, meta = cio.locate(path, "torch")
        token = cio.Origin.of(d).token
    except Exception as exc:
        error = cio.describe(exc)
    hint = "Nothing was loaded. Restore or re-create the checkpoint, or resume from another one"
    cio.agree(dev, error, f"load from {path}", hint, token)
    assert d is not None and meta is not None
    cio.read_state(state, d, meta, what=f"load from {path}", hint=hint)
    mine = cio.read_rank_state(d, meta, dist.get_rank())
    return dict(meta.get("extra") or {}), mine, cio.Origin.of(d)
