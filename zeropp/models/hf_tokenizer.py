"""The tokenizer of a run from ``model.pretrained``, copied into its Hugging Face export.

A run's checkpoint holds the model, not the tokenizer; a run from a ``save_pretrained`` /
hub directory (``model.pretrained=<dir>``) was trained on that directory's tokenizer, so an
export without it loads in ``transformers`` but cannot turn text into the ids it was trained on.
:func:`copy_tokenizer` copies the tokenizer files that directory has (a fixed list of the names
``transformers``' tokenizers save: data only, never code, so a ``tokenizer_config.json`` naming
remote code still needs ``trust_remote_code`` to use it) into the export.

Only what is plainly the directory's own is read: a file that is a symlink resolving outside
the directory (a hub cache's ``snapshots/<rev>`` links into ``../../blobs``) is skipped, as is
anything that is not a regular file or is larger than :data:`MAX_TOKENIZER_BYTES`; each skip is
reported with its reason (``zeropp_export.json``'s ``tokenizer_skipped``, one ``warning:`` line of
``python -m experiments.export``). Nothing is executed and nothing in the source is changed.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..input_files import read_regular

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
)
"""The files ``PreTrainedTokenizer(Fast).save_pretrained`` writes (BPE, WordPiece and
SentencePiece tokenizers, chat templates): what an export copies when the directory has them."""

MAX_TOKENIZER_BYTES = 64 << 20
"""The largest tokenizer file copied (64 MiB): above the largest vocabularies' ``tokenizer.json``
(tens of MiB), far below memory; a larger file there is not a tokenizer file."""


def copy_tokenizer(source: str | os.PathLike[str] | None, out_dir: Path) -> tuple[list[str], dict[str, str]]:
    """Copy the tokenizer files of directory ``source`` (the run's ``model.pretrained``; None: no
    such directory, nothing to copy) into ``out_dir``; returns the names copied and, for those
    skipped, why. A ``source`` that is gone is one skip (``"(directory)"``), not an error: the
    export itself does not need it."""
    if source is None:
        return [], {}
    root = Path(source).expanduser()
    try:
        real_root = root.resolve(strict=True)
    except OSError as e:
        return [], {"(directory)": f"{root} cannot be read ({e.strerror or e}): no tokenizer copied"}
    if not real_root.is_dir():
        return [], {"(directory)": f"{root} is not a directory: no tokenizer copied"}
    copied: list[str] = []
    skipped: dict[str, str] = {}
    for name in TOKENIZER_FILES:
        path = root / name
        if not (path.exists() or path.is_symlink()):
            continue
        real = Path(os.path.realpath(path))
        if not real.is_relative_to(real_root):
            skipped[name] = f"a symlink to {real}, outside {root}: not followed"
            continue
        try:
            data = read_regular(real, limit=MAX_TOKENIZER_BYTES)
        except OSError as e:
            skipped[name] = f"{e.strerror or e}"
            continue
        (out_dir / name).write_bytes(data)
        copied.append(name)
    return copied, skipped


__all__ = ["MAX_TOKENIZER_BYTES", "TOKENIZER_FILES", "copy_tokenizer"]
