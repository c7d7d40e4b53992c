"""``experiments.launch.failure.root_cause`` on written error texts: which rank a stopped world blames."""

from __future__ import annotations

import time
from pathlib import Path

from zeropp.experiments.launch.failure import root_cause
from zeropp.runtime.batch import on_ranks, origin_ranks

AGREED = f"CheckpointError: checkpoint load failed {on_ranks([0])} of 2: rank 0: meta.json fails its checksum"


def _blame(tmp_path: Path, texts: dict[int, str], first: dict[int, int]) -> int:
    for r, text in texts.items():
        (tmp_path / f"rank{r}.err").write_text(text)
    failure = root_cause(
        first,
        dict.fromkeys(texts, 1),
        pids={r: 10**7 + r for r in texts},
        error_files={r: str(tmp_path / f"none{r}.json") for r in texts},
        log_dir=tmp_path,
        stopped_at=time.time() + 60,
        ranks_per_node=None,
    )
    assert failure.rank is not None
    return failure.rank


def test_the_phrase_reads_back() -> None:
    assert origin_ranks(f"x raised {on_ranks({2, 0})}, so") == [0, 2]
    assert origin_ranks("nothing here") == []


def test_an_error_raised_alike_everywhere_blames_the_rank_it_names(tmp_path: Path) -> None:
    """Rank 1 exited first with the error every rank raised about rank 0's file: rank 0 is named."""
    assert _blame(tmp_path, {0: AGREED, 1: AGREED}, first={1: 1}) == 0


def test_a_named_rank_outside_the_failed_ones_changes_nothing(tmp_path: Path) -> None:
    """An error naming a rank that did not fail (or is not in this world) is not an echo: the first rank stays."""
    text = AGREED.replace(on_ranks([0]), on_ranks([5]))
    assert _blame(tmp_path, {0: "RuntimeError: boom", 1: text}, first={1: 1}) == 1
