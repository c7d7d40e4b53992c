"""Token sources: a real text corpus that is always available offline, or random tokens.

The model has a byte-level vocabulary (256), so any file is a token stream as it is. The default
corpus is this interpreter's own standard library (``*.py`` under ``sysconfig``'s stdlib path,
sorted, so every rank and every machine with the same Python reads the same bytes): real,
structured text, a few MB, no download. ``data=licenses`` reads Debian's license texts instead;
``data.source=path data.path=...`` reads any file or directory.

Each rank draws its own random windows (seeded by seed and rank): data parallelism with
different data on each rank, reproducible across runs.
"""

from __future__ import annotations

import fnmatch
import os
import sysconfig
from pathlib import Path

import torch

from .config import MIN_CORPUS_BYTES, DataConfig


class DataError(RuntimeError):
    """The corpus could not be read; the message says where it looked and what to do."""


SKIPPED_DIR = "site-packages"
"""No file with a path component of this name is corpus: the interpreter's tree holds installed
packages there, which are not the standard library and differ between machines."""


def _files_under(root: Path, pattern: str) -> list[Path]:
    """The files under ``root`` whose names match ``pattern``, none with a ``site-packages`` path
    component, sorted as paths: what ``sorted(p for p in root.rglob(pattern) if p.is_file() and
    "site-packages" not in p.parts)`` gives (symlinked directories not entered, unreadable
    directories skipped), but without walking the skipped trees, which in an interpreter's own
    tree hold far more files than the standard library (every rank reads the corpus)."""
    if SKIPPED_DIR in root.parts:
        return []

    def unreadable(e: OSError) -> None:
        if not isinstance(e, PermissionError):  # rglob skips only unreadable directories
            raise e

    found = []
    for top, dirs, names in os.walk(root, onerror=unreadable):
        dirs[:] = [d for d in dirs if d != SKIPPED_DIR]
        found += [Path(top, n) for n in names if n != SKIPPED_DIR and fnmatch.fnmatchcase(n, pattern)]
    return sorted(p for p in found if p.is_file())


def read_corpus(data: DataConfig) -> bytes:
    """The corpus bytes (at most ``data.max_bytes``), or a :class:`DataError` naming the path.
    A file that cannot be read is an error too (the corpus would silently be another one)."""
    if data.source == "python_stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        files = _files_under(root, "*.py") if root.is_dir() else []
        where = f"Python standard library sources under {root}"
    else:
        root = Path(str(data.path)).expanduser()
        if root.is_file():
            files = [root]
        elif root.is_dir():
            files = _files_under(root, "*")
        elif root.exists():
            raise DataError(
                f"data.path={str(root)!r} is neither a file nor a directory; point data.path at a text "
                "file or a folder of them"
            )
        else:
            raise DataError(
                f"data.path={str(root)!r} does not exist; point data.path at a file or "
                "directory, or use data=text (Python's own sources) or data=random"
            )
        where = str(root)
    chunks: list[bytes] = []
    total = 0
    for f in files:
        try:
            b = f.read_bytes()
        except OSError as e:
            if data.source == "python_stdlib":
                continue  # the interpreter's own tree: an odd unreadable module does not change the corpus' nature
            raise DataError(
                f"data.path={where!r}: cannot read {f} ({e.strerror or e}); make it readable or point "
                "data.path elsewhere"
            ) from None
        chunks.append(b)
        total += len(b)
        if total >= data.max_bytes:
            break
    corpus = b"".join(chunks)[: data.max_bytes]
    if len(corpus) < MIN_CORPUS_BYTES:
        if data.source == "path":
            raise DataError(
                f"data.path={where!r} holds only {len(corpus)} bytes; need at least {MIN_CORPUS_BYTES}. "
                "Point data.path at a larger text file or folder, or use data=random"
            )
        raise DataError(
            f"found only {len(corpus)} bytes of text in {where}; need at least {MIN_CORPUS_BYTES}. "
            "Use data=random or set data.source=path data.path=<a text file or folder>"
        )
    return corpus


def _check_length(n: int, data: DataConfig, seq_len: int) -> None:
    """The training part of an ``n``-byte corpus must hold one window of ``seq_len + 1`` tokens."""
    if n - int(n * data.val_fraction) < seq_len + 2:
        where = f"data.path={data.path!r}" if data.source == "path" else "the corpus"
        raise DataError(
            f"{where} gives {n} bytes, {n - int(n * data.val_fraction)} after holding out "
            f"data.val_fraction={data.val_fraction}: shorter than one training sequence "
            f"(model.seq_len={seq_len} + 2); use a larger corpus or data.max_bytes, or a smaller model.seq_len"
        )


def check_corpus(data: DataConfig, seq_len: int) -> int:
    """Read the corpus as the ranks will and check it holds a training sequence; its size in bytes.
    The runner calls it before any rank starts, so a missing, unreadable or too short
    ``data.path`` is refused there (reading is cheap: at most ``data.max_bytes``)."""
    n = len(read_corpus(data))
    _check_length(n, data, seq_len)
    return n


class TokenBatches:
    """Draws ``(idx, targets)`` micro-batches of shape ``[batch, seq_len]`` for one rank."""

    def __init__(
        self, data: DataConfig, *, seq_len: int, batch: int, vocab_size: int, seed: int, rank: int, device: torch.device
    ) -> None:
        self.data = data
        self.seq_len = seq_len
        self.batch = batch
        self.vocab_size = vocab_size
        self.device = device
        self.gen = torch.Generator().manual_seed(seed * 1_000_003 + rank)
        self.train: torch.Tensor | None = None
        self.val: torch.Tensor | None = None
        if data.kind == "text":
            tokens = torch.frombuffer(bytearray(read_corpus(data)), dtype=torch.uint8).long()
            _check_length(len(tokens), data, seq_len)
            n_val = int(len(tokens) * data.val_fraction)
            self.train = tokens[: len(tokens) - n_val]
            self.val = tokens[len(tokens) - n_val :] if n_val > seq_len + 1 else self.train
            if int(tokens.max()) >= vocab_size:
                raise DataError(f"corpus has byte values >= model vocab_size={vocab_size}")

    @property
    def num_tokens(self) -> int:
        return 0 if self.train is None else len(self.train)

    def _windows(self, source: torch.Tensor | None, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        if source is None:
            x = torch.randint(0, self.vocab_size, (self.batch, self.seq_len + 1), generator=gen)
        else:
            starts = torch.randint(0, len(source) - self.seq_len - 1, (self.batch,), generator=gen)
            x = torch.stack([source[s : s + self.seq_len + 1] for s in starts.tolist()])
        x = x.to(self.device)
        return x[:, :-1].contiguous(), x[:, 1:].contiguous()

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next training micro-batch."""
        return self._windows(self.train, self.gen)

    def skip(self, n: int) -> None:
        """Advance past ``n`` training micro-batches without building them: a resumed run then
        draws exactly the batches the uninterrupted run would have drawn next."""
        for _ in range(n):
            if self.train is None:
                torch.randint(0, self.vocab_size, (self.batch, self.seq_len + 1), generator=self.gen)
            else:
                torch.randint(0, len(self.train) - self.seq_len - 1, (self.batch,), generator=self.gen)

    def eval_batch(self, index: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """A fixed held-out batch (the same on every call with the same index)."""
        gen = torch.Generator().manual_seed(10_000_019 + index)
        return self._windows(self.val, gen)
