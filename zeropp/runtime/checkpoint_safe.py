"""Reading ``torch.distributed.checkpoint`` (DCP) files without running code from them.

DCP reads a checkpoint's ``.metadata`` with a plain ``pickle.load`` (``FileSystemReader.read_metadata``)
and every non-tensor value with ``torch.load(..., weights_only=False)`` (``DefaultLoadPlanner.load_bytes``),
so a crafted file runs whatever its pickle names. torch has no option to restrict either: its
safe-globals mechanism (``torch.serialization.safe_globals``) only governs ``torch.load`` with
``weights_only=True``, and ``.metadata`` is a bare pickle stream, not a ``torch.save`` archive. So:

* :func:`read_metadata` unpickles ``.metadata`` through :class:`_MetadataUnpickler`, a
  ``pickle.Unpickler`` whose ``find_class`` admits only the classes DCP's metadata is built from
  (``torch.distributed.checkpoint.metadata``, the filesystem storage record, torch dtypes,
  ``torch.Size``, the layout lookup and ``pathlib`` paths); any other global is refused before it
  is looked up, so nothing it names is imported or called. The result must be a ``Metadata``
  whose storage records name only files the checkpoint lists (no path outside its folder).
* :class:`SafeReader` is a ``FileSystemReader`` that reads its metadata that way.
* :class:`SafeLoadPlanner` is DCP's default load planner with non-tensor values decoded by
  ``torch.load(..., weights_only=True)`` (torch's own restricted unpickler).

Use both for every ``dcp.load`` of a file this program did not just write.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any, Collection, Mapping

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata

from .checkpoint_files import METADATA

_ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", "Metadata"),
        ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "TensorProperties"),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
        ("torch.distributed.checkpoint.metadata", "StorageMeta"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a lookup in torch's table of layouts by name
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"),
        ("pathlib._local", "PosixPath"),
        ("pathlib._local", "WindowsPath"),
        ("pathlib._local", "PurePosixPath"),
        ("pathlib._local", "PureWindowsPath"),
    }
)
"""``(module, name)`` of every global a DCP ``.metadata`` pickle refers to, besides torch dtypes."""


class UnsafeCheckpointError(ValueError):
    """A checkpoint file refers to something a checkpoint never holds (it may be crafted to run code)."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata, refusing every global outside :data:`_ALLOWED` and torch's dtypes."""

    def __init__(self, file: Any, source: Path) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self.source} refers to {module}.{name}, which checkpoint metadata never holds: refusing to read it "
            f"(the file was not written by torch.distributed.checkpoint and may be crafted to run code). Restore "
            f"the checkpoint from a trusted copy or load an older one"
        )


def read_metadata(folder: str | os.PathLike, files: Collection[str] | None = None) -> Metadata:
    """The DCP ``Metadata`` of checkpoint folder ``folder``, read without running code from it.
    ``files``: the file names the checkpoint lists; every storage record must name one of them
    (None: any plain name inside the folder). Raises :class:`UnsafeCheckpointError` otherwise."""
    src = Path(folder) / METADATA
    with open(src, "rb") as f:
        try:
            md = _MetadataUnpickler(f, src).load()
        except UnsafeCheckpointError:
            raise
        except Exception as exc:
            raise ValueError(f"{src} cannot be read ({type(exc).__name__}: {exc}): the file is corrupt") from exc
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise UnsafeCheckpointError(f"{src} does not hold checkpoint metadata (it holds {type(md).__name__})")
    storage = md.storage_data
    if not isinstance(storage, dict):
        raise UnsafeCheckpointError(f"{src} has no storage records (storage_data is {type(storage).__name__})")
    for info in storage.values():
        rel = getattr(info, "relative_path", None)
        ok = isinstance(rel, str) and rel == Path(rel).name and rel not in ("", ".", "..")
        if not ok or (files is not None and rel not in files):
            raise UnsafeCheckpointError(
                f"{src} points at data file {rel!r}, which is not one of the checkpoint's "
                f"files {sorted(files) if files is not None else ''}: refusing to read it"
            )
    if md.storage_meta is None:
        md.storage_meta = StorageMeta()
    return md


def tensor_entry(
    entries: Mapping[str, TensorStorageMetadata | BytesStorageMetadata], key: str
) -> TensorStorageMetadata:
    """The record of tensor ``key`` in ``entries`` (a checkpoint's ``Metadata.state_dict_metadata``):
    its size and dtype. A record under that name that holds bytes (another writer's checkpoint, or a
    crafted one) is a ValueError rather than an AttributeError later."""
    entry = entries[key]
    if not isinstance(entry, TensorStorageMetadata):
        raise ValueError(
            f"checkpoint entry {key!r} holds {type(entry).__name__}, not a tensor: the checkpoint was "
            f"not written by this trainer"
        )
    return entry


class SafeReader(FileSystemReader):
    """DCP's ``FileSystemReader`` whose ``.metadata`` is read by :func:`read_metadata` (restricted
    to checkpoint metadata classes and to data files among ``files``)."""

    def __init__(self, path: str | os.PathLike, files: Collection[str] | None = None) -> None:
        super().__init__(path)
        self.files = files

    def read_metadata(self) -> Metadata:  # no ``rank`` kwarg: DCP must not fall back to per-rank files
        md = read_metadata(self.path, self.files)
        assert md.storage_meta is not None
        md.storage_meta.load_id = self.load_id
        return md


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor values (optimizer hyper-parameters, scheduler
    state) are decoded with ``torch.load(..., weights_only=True)``, which admits only plain
    containers, numbers, strings and tensors. The decoded value is re-encoded for the parent's
    ``load_bytes`` (whose own ``torch.load`` then only meets what this one admitted), so the
    parent's placement logic is reused unchanged."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            why = next((ln.strip() for ln in str(exc).splitlines() if "GLOBAL" in ln), str(exc).splitlines()[0])
            raise UnsafeCheckpointError(
                f"checkpoint value {read_item.dest_index.fqn!r} holds something other than "
                f"plain data ({why}); refusing to read it (the file may be crafted to run "
                f"code). Restore the checkpoint from a trusted copy"
            ) from exc
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        super().load_bytes(read_item, buf)
