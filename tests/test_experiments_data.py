"""Token sources: the offline corpora read as bytes, random tokens, and a clear error when missing."""

from __future__ import annotations

import pytest
import torch

from zeropp.experiments.config import DataConfig
from zeropp.experiments.data import DataError, TokenBatches


@pytest.mark.parametrize("data", [DataConfig(kind="text", source="python_stdlib", max_bytes=100_000),
                                  DataConfig(kind="random")])
def test_batches_are_shifted_windows(data: DataConfig) -> None:
    tb = TokenBatches(data, seq_len=16, batch=3, vocab_size=256, seed=0, rank=0, device=torch.device("cpu"))
    x, y = tb.next()
    assert x.shape == y.shape == (3, 16) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1]) and int(x.max()) < 256
    other = TokenBatches(data, seq_len=16, batch=3, vocab_size=256, seed=0, rank=1, device=torch.device("cpu"))
    assert not torch.equal(other.next()[0], TokenBatches(data, seq_len=16, batch=3, vocab_size=256, seed=0, rank=0,
                                                         device=torch.device("cpu")).next()[0])
    assert torch.equal(tb.eval_batch()[0], other.eval_batch()[0])  # the same held-out batch on every rank


def test_missing_corpus_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        TokenBatches(DataConfig(kind="text", source="path", path=str(tmp_path / "nope")), seq_len=8, batch=1,
                     vocab_size=256, seed=0, rank=0, device=torch.device("cpu"))
    (tmp_path / "small.txt").write_bytes(b"tiny")
    with pytest.raises(DataError, match="data=random"):
        TokenBatches(DataConfig(kind="text", source="path", path=str(tmp_path / "small.txt")), seq_len=8, batch=1,
                     vocab_size=256, seed=0, rank=0, device=torch.device("cpu"))
