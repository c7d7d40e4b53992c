"""Tied (shared) parameters at every stage: one shard, one gradient, counted once.

Here: the one-process checks. The topic's full description and its gloo-world checks are in
``tests/distributed/test_runtime_tied.py``.
"""

from __future__ import annotations

import torch

from tests.runtime_helpers import TINY
from zeropp.models import GPT, GPTConfig


def test_gpt_config_ties_by_default_and_counts_once() -> None:
    m = GPT(TINY)
    assert TINY.tie_embeddings and m.head.weight is m.tok_emb.weight
    names = [n for n, _ in m.named_parameters(remove_duplicate=False)]
    assert "head.weight" in names and "head.weight" not in dict(m.named_parameters())
    for preset in ("tiny", "mini", "small"):
        for tie in (True, False):
            c = GPTConfig.preset(preset, tie_embeddings=tie)
            assert c.num_params() == sum(p.numel() for p in GPT(c).parameters()), (preset, tie)
    # both uses are summed into the one gradient
    idx = torch.randint(0, 256, (2, 16))
    _, loss = m(idx, idx)
    loss.backward()
    assert m.tok_emb.weight.grad is m.head.weight.grad
    try:
        GPTConfig(tie_embeddings="yes")  # type: ignore[arg-type]
    except ValueError as e:
        assert "tie_embeddings" in str(e)
    else:
        raise AssertionError("a non-bool tie_embeddings must be refused")
