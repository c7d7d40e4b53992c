"""Token sources: the offline corpora read as bytes, random tokens, and a clear error when missing."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch

from zeropp.experiments.runner.config import DataConfig
from zeropp.experiments.runner.data import DataError, TokenBatches, _files_under


@pytest.mark.parametrize(
    "data", [DataConfig(kind="text", source="python_stdlib", max_bytes=100_000), DataConfig(kind="random")]
)
def test_batches_are_shifted_windows(data: DataConfig) -> None:
    tb = TokenBatches(data, seq_len=16, batch=3, vocab_size=256, seed=0, rank=0, device=torch.device("cpu"))
    x, y = tb.next()
    assert x.shape == y.shape == (3, 16) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1]) and int(x.max()) < 256
    other = TokenBatches(data, seq_len=16, batch=3, vocab_size=256, seed=0, rank=1, device=torch.device("cpu"))
    assert not torch.equal(
        other.next()[0],
        TokenBatches(data, seq_len=16, batch=3, vocab_size=256, seed=0, rank=0, device=torch.device("cpu")).next()[0],
    )
    assert torch.equal(tb.eval_batch()[0], other.eval_batch()[0])  # the same held-out batch on every rank


def test_missing_corpus_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        TokenBatches(
            DataConfig(kind="text", source="path", path=str(tmp_path / "nope")),
            seq_len=8,
            batch=1,
            vocab_size=256,
            seed=0,
            rank=0,
            device=torch.device("cpu"),
        )
    (tmp_path / "small.txt").write_bytes(b"tiny")
    with pytest.raises(DataError, match="data=random"):
        TokenBatches(
            DataConfig(kind="text", source="path", path=str(tmp_path / "small.txt")),
            seq_len=8,
            batch=1,
            vocab_size=256,
            seed=0,
            rank=0,
            device=torch.device("cpu"),
        )


def test_evaluation_averages_distinct_batches_per_rank_and_round() -> None:
    """``train.eval_batches``: round k on rank r reads held-out batch k * world + r, and the result
    is the mean of the (collective) per-round losses."""
    from zeropp.experiments.runner.train_eval import evaluate

    tb = TokenBatches(
        DataConfig(kind="text", source="python_stdlib", max_bytes=100_000),
        seq_len=8,
        batch=2,
        vocab_size=256,
        seed=0,
        rank=0,
        device=torch.device("cpu"),
    )
    seen: list[torch.Tensor] = []

    class Trainer:
        def eval_loss(self, idx: torch.Tensor, targets: torch.Tensor) -> float:
            seen.append(idx)
            return float(idx[0, 0])  # a loss that depends on the batch read

    got = evaluate(Trainer(), tb, 3, rank=1, world=4)
    want = [tb.eval_batch(i)[0] for i in (1, 5, 9)]
    assert len(seen) == 3 and all(torch.equal(a, b) for a, b in zip(seen, want))
    assert got == pytest.approx(sum(float(w[0, 0]) for w in want) / 3)
    assert not torch.equal(tb.eval_batch(1)[0], tb.eval_batch(5)[0])
    from zeropp.experiments.runner.config import TrainConfig

    with pytest.raises(ValueError, match="train.eval_batches"):
        TrainConfig(eval_batches=0)


def _rglob_reference(root: Path, pattern: str) -> list[Path]:
    """The corpus' file list as the plain pathlib expression gives it (walks every tree)."""
    return sorted(p for p in root.rglob(pattern) if p.is_file() and "site-packages" not in p.parts)


def test_corpus_files_are_rglobs_without_walking_site_packages(tmp_path: Path) -> None:
    """The pruned walk lists exactly what the rglob expression lists, in the same order: nested
    site-packages trees (and a file of that name) left out, a symlinked directory not entered, a
    symlinked file kept, a dangling link and directories dropped, dotfiles kept, and path order
    (``a/`` before ``a-b/``), not string order."""
    root = tmp_path / "lib"
    for rel in ["a/x.py", "a-b/x.py", "a/.hidden.py", "b/site-packages/pkg/m.py", "site-packages/y.py", "c/d/e/z.py"]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(rel)
    (root / "c" / "site-packages").write_text("a file of that name")
    (root / "c" / "notes.txt").write_text("not python")
    (root / "dir.py").mkdir()
    (root / "linked").symlink_to(root / "a", target_is_directory=True)
    (root / "link.py").symlink_to(root / "c" / "d" / "e" / "z.py")
    (root / "dangling.py").symlink_to(root / "nowhere.py")
    for pattern in ("*.py", "*"):
        assert _files_under(root, pattern) == _rglob_reference(root, pattern), pattern
    assert [p.relative_to(root).as_posix() for p in _files_under(root, "*.py")] == [
        "a/.hidden.py",
        "a/x.py",
        "a-b/x.py",
        "c/d/e/z.py",
        "link.py",
    ]
    inside = root / "b" / "site-packages"
    assert _files_under(inside, "*") == _rglob_reference(inside, "*") == []  # a root inside one: nothing
    stdlib = Path(sysconfig.get_paths()["stdlib"])  # the default corpus' own tree
    assert _files_under(stdlib, "*.py") == _rglob_reference(stdlib, "*.py")
