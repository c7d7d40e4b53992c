"""What a local ``save_pretrained`` directory holds, checked before a model is built from it.

``HFConfig.pretrained`` names a directory a user copied, converted or wrote themselves; it may be
incomplete, corrupt or crafted. ``transformers`` itself loads such a directory leniently: a
weight missing from the file is silently initialised at random, a weight the model does not
have is dropped, a ``pytorch_model.bin`` is unpickled, a broken file is a traceback from inside
every rank. Here, before any rank starts and before any tensor is read:

- :func:`read_saved_config` reads ``config.json`` as a bounded regular file (a FIFO or
  ``/dev/zero`` there would block or exhaust memory) and requires a JSON object;
- :func:`check_pretrained_weights` reads only the *headers* of the safetensors files (names,
  dtypes, shapes, byte ranges: JSON, no code) and compares them with the model the settings
  describe, built on the meta device. A missing, extra or mis-shaped weight, a truncated file,
  a shard index naming a file outside the directory, or pickled weights only are each one
  ``ValueError`` naming the file and what to change.

Pickled weights (``pytorch_model.bin``) are refused rather than read with a restricted
unpickler: nothing zeropp reads from disk runs code, and safetensors is what ``save_pretrained``
writes by default.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

from ..input_files import read_head, read_regular

CONFIG_LIMIT = 16 << 20
"""The largest ``config.json`` read (16 MiB; real ones are a few KiB)."""

HEADER_LIMIT = 100 << 20
"""The largest safetensors header read (safetensors' own limit is 100 MB)."""

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"

_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
"""The safetensors dtypes a float model's weights come in, and their sizes."""


def read_saved_config(path: Path) -> dict[str, Any]:
    """The JSON object in ``path`` (a ``config.json``), or ``ValueError`` naming the file."""
    try:
        saved = json.loads(read_regular(path, CONFIG_LIMIT))
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise ValueError(f"{path} is not JSON ({e}); give a config.json written by save_pretrained") from None
    if not isinstance(saved, dict):
        raise ValueError(f"{path} holds a JSON {type(saved).__name__}, not the object save_pretrained writes")
    return saved


def _header(file: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Name -> (dtype, shape) of every tensor in the safetensors ``file``, from its header only;
    ``ValueError`` when the header is not a valid one or the file is shorter than it says."""
    try:
        head, size = read_head(file, 8)
        if len(head) < 8:
            raise ValueError(f"{file} is {size} bytes long, too short for a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > min(HEADER_LIMIT, size - 8):
            raise ValueError(f"{file} is not a safetensors file or is truncated (its header claims {n:,} bytes)")
        raw, _ = read_head(file, n, 8)
    except OSError as e:
        raise ValueError(f"cannot read {file}: {e.strerror or e}") from None
    try:
        entries = json.loads(raw)
    except ValueError:
        raise ValueError(f"{file} is not a safetensors file (its header is not JSON)") from None
    if not isinstance(entries, dict):
        raise ValueError(f"{file} is not a safetensors file (its header is not a JSON object)")
    data = size - 8 - n
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, entry in entries.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise ValueError(f"{file} is not a safetensors file (entry {name!r} is malformed)") from None
        if dtype not in _DTYPE_BYTES:
            raise ValueError(
                f"{file}: {name} is stored as {dtype}; a model's weights load from {', '.join(_DTYPE_BYTES)} only"
            )
        numel = 1
        for d in shape:
            numel *= d
        if not (0 <= begin <= end <= data) or end - begin != numel * _DTYPE_BYTES[dtype]:
            raise ValueError(f"{file} is truncated or corrupt: {name}'s bytes lie outside the file")
        out[name] = (dtype, shape)
    return out


def _weights_name(directory: Path) -> str | None:
    """The weights file transformers reads in ``directory``, in its order: the file config.json
    names (``transformers_weights``), else ``model.safetensors``, else the shard index; None: none."""
    explicit = read_saved_config(directory / "config.json").get("transformers_weights")
    if explicit is not None:
        if explicit not in (WEIGHTS, INDEX):  # transformers would also take a pickled adapter_model.bin
            raise ValueError(
                f"{directory / 'config.json'} names its weights file transformers_weights={explicit!r}; zeropp "
                f"reads {WEIGHTS} or {INDEX} only: remove the key, or save the model with save_pretrained"
            )
        return str(explicit)
    for name in (WEIGHTS, INDEX):
        if (directory / name).exists() or (directory / name).is_symlink():
            return name
    return None


def saved_weights(directory: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Name -> (dtype, shape) of every weight ``directory`` holds (``model.safetensors``, or the
    shards its ``model.safetensors.index.json`` lists, each a plain file name in ``directory``):
    the file transformers would read there."""
    name = _weights_name(directory)
    if name == INDEX:
        index = read_saved_config(directory / INDEX)
        wmap = index.get("weight_map")
        if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
            raise ValueError(f"{directory / INDEX} has no weight_map of tensor name -> file name")
        files = sorted(set(wmap.values()))
        outside = [f for f in files if Path(f).name != f or f in (".", "..")]
        if outside:
            raise ValueError(
                f"{directory / INDEX} names {outside[0]!r}, which is not a file of {directory}: refusing to read it"
            )
        out: dict[str, tuple[str, tuple[int, ...]]] = {}
        for f in files:
            out.update(_header(directory / f))
        unlisted = sorted(set(wmap) - set(out))
        if unlisted:
            raise ValueError(f"{directory / INDEX} lists {unlisted[:3]}, which its shards do not hold")
        return out
    if name == WEIGHTS:
        return _header(directory / WEIGHTS)
    pickled = sorted(p.name for p in directory.glob("*.bin"))
    what = f"only {', '.join(pickled)} (pickled weights)" if pickled else "no weights file"
    raise ValueError(
        f"HFConfig.pretrained={str(directory)!r} holds {what}; zeropp loads {WEIGHTS} (or sharded "
        f"with {INDEX}) only, since loading a pickle can run code: write the model with "
        "save_pretrained (safetensors is its default)"
    )


LEGACY_EXTRA = (r"rotary_emb\.inv_freq$", r"(^|\.)position_ids$", r"attn\.masked_bias$")
"""Saved names older ``transformers`` versions wrote that today's versions drop when loading: the
rotary embedding's ``inv_freq`` buffer (Llama checkpoints saved before 4.31), position-id buffers,
GPT-2's ``attn.masked_bias``. They hold nothing the model learns."""


def ignorable(model: Any, name: str) -> bool:
    """Whether a saved weight ``name`` that ``model`` has no parameter or buffer for may be left
    out: the model's own ``_keys_to_ignore_on_load_unexpected`` patterns (its instance's, which
    ``transformers`` merges from its submodules) or one of :data:`LEGACY_EXTRA`."""
    patterns = [*(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()), *LEGACY_EXTRA]
    return any(re.search(p, name) for p in patterns)


def tied_names(model: Any) -> dict[str, list[str]]:
    """Every name of a tied parameter (one registered under several names, e.g. an embedding and
    the output head) to all its names, in registration order; untied names are absent. A tied
    weight may be saved under any one of its names (a checkpoint stores it once), which both the
    check of a pretrained directory and the export of a run's weights must accept."""
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    return {n: names for names in aliases.values() for n in names if len(names) > 1}


def check_pretrained_weights(cfg: Any, model_cls: Any, conf: Any) -> None:
    """``ValueError`` unless the weights of ``cfg.pretrained`` are exactly those of ``model_cls(conf)``
    (names and shapes; a tied weight may be saved under either of its names, a name the class
    declares ignorable may be extra). Builds the model on the meta device: no memory, no weights."""
    import torch

    directory = Path(cfg.pretrained).expanduser()
    try:
        saved = saved_weights(directory)
    except ValueError as e:
        msg = str(e)
        raise ValueError(
            msg if msg.startswith("HFConfig.") else f"HFConfig.pretrained={str(directory)!r}: {msg}"
        ) from None
    with torch.device("meta"):
        model = model_cls(conf)
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    prefix = model.base_model_prefix + "."
    if not any(k.startswith(prefix) for k in saved) and any(k.startswith(prefix) for k in want):
        saved = {
            prefix + k: v for k, v in saved.items()
        }  # a base model's checkpoint (GPT2Model), as transformers maps it
    tied = tied_names(model)
    missing = sorted(k for k in want if k not in saved and not any(t in saved for t in tied.get(k, ())))
    extra = sorted(k for k in saved if k not in want and not ignorable(model, k))
    shapes = sorted(
        f"{k} {list(saved[k][1])} (the model: {list(want[k])})" for k in want if k in saved and saved[k][1] != want[k]
    )
    if missing or extra or shapes:
        parts = [f"missing {missing[:4]}" if missing else "", f"not in the model {extra[:4]}" if extra else ""]
        parts.append(f"shaped differently: {', '.join(shapes[:3])}" if shapes else "")
        raise ValueError(
            f"HFConfig.pretrained={str(directory)!r}: its weights are not those of the {cfg.hf_config} model "
            f"its config.json describes ({'; '.join(p for p in parts if p)}); give a complete directory "
            "written by save_pretrained for this model"
        )


__all__ = ["LEGACY_EXTRA", "check_pretrained_weights", "ignorable", "read_saved_config", "saved_weights", "tied_names"]
