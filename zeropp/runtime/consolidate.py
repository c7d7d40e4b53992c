"""Plain weights back from a sharded engine: the unwrapped model's ``state_dict``.

Every unit's fp32 master is assembled whole (a replicated unit's is already whole; a sharded one
is all-gathered by the caller's ``gather``), split into parameters by the unit's layout and cast
to each parameter's original dtype. Frozen parameters come back unrounded (the originals the
engine kept when the compute-dtype cast rounds), buffers as they are. Everything lands on the CPU.
A tied parameter comes back under each of its names (separate tensors with equal values, as
``load_state_dict`` into the unwrapped, tied model expects).

:func:`read_consolidated` does the same offline, from a checkpoint directory, in one process
(DCP reads every rank's pieces; no process group), and :func:`export_consolidated` writes its
result to one ``torch.save`` file.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence, Union

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from ..output_files import creation_refused
from . import checkpoint_io as cio
from .checkpoint_files import latest, read_meta, verify
from .checkpoint_safe import SafeLoadPlanner, read_metadata, tensor_entry
from .partition import FlatUnit, UnitLayout, unflatten
from .tensor_parallel import merge_pieces


@torch.no_grad()
def consolidated_state_dict(
    units: Sequence[FlatUnit],
    masters: Union[Sequence[torch.Tensor], Callable[[int], torch.Tensor]],
    gather: Callable[[FlatUnit, torch.Tensor], torch.Tensor],
    model: nn.Module,
    param_dtypes: dict[str, torch.dtype],
    frozen_originals: dict[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """``masters`` gives each unit's fp32 master shard: a list, or ``masters(i)`` fetching it one
    unit at a time (an offloaded optimizer reads it back from host memory or disk, so only one
    unit's master is materialized at once). ``gather(unit, master_shard)`` returns the unit's full
    ``[padded]`` fp32 master (collective for sharded units, so every rank must call this)."""
    master = masters if callable(masters) else masters.__getitem__
    full_params: dict[str, torch.Tensor] = {}
    for i, u in enumerate(units):
        m = master(i)
        full = m if u.kind == "replicated" else gather(u, m)  # [padded]
        for name, t in u.unflatten(full).items():
            full_params[name] = t.to(dtype=param_dtypes[name], device="cpu").clone()
    # a tied parameter appears in state_dict under each of its names; the units and frozen_originals
    # know it by its first name in named_parameters(), so look every name up by the tensor's identity
    first = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for k, v in model.state_dict(keep_vars=True).items():
        name = first.get(id(v), k)
        if k in full_params:
            out[k] = full_params[k]
        elif name in full_params:
            out[k] = full_params[name].clone()  # an alias not recorded in the layout: the same values
        elif name in frozen_originals:  # a frozen parameter in its original dtype, not the compute copy
            out[k] = frozen_originals[name].detach().to("cpu").clone()
        else:
            out[k] = v.detach().to("cpu").clone()
    return out


def read_consolidated(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict]:
    """The unwrapped model's ``state_dict`` from the latest checkpoint under ``path``, and that
    version's ``meta.json``. One process, no process group (DCP reads every rank's pieces, no_dist).

    An engine checkpoint (``trainer=zeropp``) gives the fp32 masters cast to each parameter's dtype,
    plus frozen parameters and buffers, a tensor-parallel one's tp pieces merged into the unsplit
    weights; a torch trainers' checkpoint (``trainer=fsdp2`` / ``ddp``) gives its ``model`` entries,
    whole whatever the world size that saved them. Every file is verified against its checksum
    first, and nothing in the checkpoint can run code."""
    d = latest(path)
    meta = read_meta(d)
    verify(d, meta, 0, 1)  # one process: it checks every file
    md = read_metadata(d, cio.data_files(meta)).state_dict_metadata
    if meta.get("kind", "engine") == "torch":
        model_keys = [k for k in md if k.startswith("model.")]
        entries = {k: tensor_entry(md, k) for k in model_keys}
        sd_t = {k: torch.empty(e.size, dtype=e.properties.dtype) for k, e in entries.items()}
        _load_no_dist(sd_t, d, meta)
        return {k.removeprefix("model."): v for k, v in sd_t.items()}, meta
    layouts = [UnitLayout.from_dict(u) for u in meta["units"]]
    tp = int(meta.get("tp", 1))
    prefixes = [f"tp{k}." if tp > 1 else "" for k in range(tp)]
    sd: dict[str, Any] = {}
    for pre in prefixes:
        sd.update({f"{pre}units.{lay.name}.masters": torch.empty(lay.numel, dtype=torch.float32) for lay in layouts})
        sd.update(
            {
                f"{pre}model.{k}": torch.empty(tensor_entry(md, f"{pre}model.{k}").size, dtype=getattr(torch, dt))
                for k, dt in meta["model_state"].items()
            }
        )
    _load_no_dist(sd, d, meta)
    pieces: dict[str, list[torch.Tensor]] = {}  # name -> one tensor per tp index
    for pre in prefixes:
        for lay in layouts:
            for name, v in unflatten(lay, sd[f"{pre}units.{lay.name}.masters"]).items():
                pieces.setdefault(name, []).append(v.to(getattr(torch, meta["param_dtypes"][name])).clone())
        for k in meta["model_state"]:
            pieces.setdefault(k, []).append(sd[f"{pre}model.{k}"])
    return merge_pieces(pieces, meta.get("tp_split", {})), meta


def _load_no_dist(sd: dict[str, Any], d: Path, meta: dict) -> None:
    with warnings.catch_warnings():  # DCP warns that no process group is used: that is the intent
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(sd, storage_reader=cio.reader(d, meta), planner=SafeLoadPlanner(), no_dist=True)


def export_consolidated(path: str | os.PathLike, out_file: str | os.PathLike) -> str:
    """Write the latest checkpoint under ``path`` as one ``torch.save`` file holding the unwrapped
    model's ``state_dict`` (:func:`read_consolidated`: fp32 masters cast to each parameter's dtype,
    plus frozen parameters and buffers; a tensor-parallel checkpoint's tp pieces merged into the
    unsplit weights). Runs in one process, no process group needed (DCP reads every piece). Every
    file is verified against its checksum first, and nothing in the checkpoint can run code.

    ``out_file`` is checked before the checkpoint is read: an empty path, a directory, a missing
    parent directory or one that refuses new files is a ValueError saying what to name instead.
    The file is written to a temporary name beside it and renamed over ``out_file`` (an existing
    file is replaced whole, never left half written); a failed write leaves no temporary behind."""
    target = _check_out_file(out_file)
    out, _meta = read_consolidated(path)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    try:
        torch.save(out, tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)  # gone after the rename; what a failed save left otherwise
    return str(target)


def _check_out_file(out_file: str | os.PathLike) -> Path:
    """``out_file`` as a Path, refused (ValueError) where :func:`export_consolidated` could not write
    it: before the checkpoint is read, so a mistyped path costs no read of the whole model."""
    if not os.fspath(out_file):
        raise ValueError("export_consolidated: out_file is an empty path; name the file to write, e.g. 'model.pt'")
    target = Path(out_file)
    if target.is_dir():
        raise ValueError(
            f"export_consolidated: out_file {target} is a directory; name a file in it, e.g. {target / 'model.pt'}"
        )
    parent = target.parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise ValueError(f"export_consolidated: out_file {target}: {parent} {what}; create it or name another file")
    err = creation_refused(parent)
    if err is not None:
        raise ValueError(
            f"export_consolidated: out_file {target}: cannot write in {parent} ({err.strerror or err}); "
            "name a file in a writable directory"
        )
    return target
