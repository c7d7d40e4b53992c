"""zeropp.comm.stats.peer_bytes: the one place the per-collective per-peer byte rules live
(zeropp's collectives and experiments/runner/commwatch.py both use it)."""

import pytest
import torch

from zeropp.comm.stats import peer_bytes


def test_peer_bytes_rules():
    assert peer_bytes("all_gather", 20, 4) == [20, 20, 20, 20]
    assert peer_bytes("all_gather", 20, 4, rank=1) == [20, 0, 20, 20]
    assert peer_bytes("reduce_scatter", 48, 4) == [12] * 4
    assert peer_bytes("reduce_scatter", 0, 4, splits=[4, 8], rank=0) == [0, 8, 0, 0]
    assert peer_bytes("all_reduce", 28, 4, rank=3) == [14, 14, 14, 0]
    assert peer_bytes("all_to_all", 64, 4) == [16] * 4
    assert peer_bytes("all_to_all", 0, 3, splits=[12, 24, 36], rank=2) == [12, 24, 0]
    assert peer_bytes("broadcast", 16, 3, rank=0, root=0) == [0, 16, 16]
    assert peer_bytes("broadcast", 16, 3, rank=1, root=0) == [0, 0, 0]
    assert peer_bytes("reduce", 16, 3, rank=1, root=2) == [0, 0, 16]
    assert peer_bytes("gather", 16, 3, rank=2, root=2) == [0, 0, 0]
    assert peer_bytes("all_gather", 20, 1) == [0]  # a group of one sends nothing
    with pytest.raises(ValueError, match="kind must be one of"):
        peer_bytes("allgather", 1, 2)
    with pytest.raises(ValueError, match="needs rank= and root="):
        peer_bytes("broadcast", 1, 2)


def test_commwatch_reads_sizes_and_defers_to_peer_bytes():
    from experiments.runner.comm_sizes import call_peer_bytes

    t = torch.zeros
    ranks = [10, 11, 12, 13]
    assert call_peer_bytes("all_gather_into_tensor", (t(20), t(5)), {}, ranks, 1) == peer_bytes(
        "all_gather", 20, 4, rank=1
    )
    assert call_peer_bytes("reduce_scatter_tensor", (t(3), t(12)), {}, ranks, 0) == peer_bytes(
        "reduce_scatter", 48, 4, rank=0
    )
    assert call_peer_bytes("all_reduce", (t(7),), {}, ranks, 2) == [14, 14, 0, 14]
    assert call_peer_bytes("all_to_all_single", (t(8), t(6, 3)), {"input_split_sizes": [1, 2, 3, 0]}, ranks, 3) == [
        12,
        24,
        36,
        0,
    ]
    assert call_peer_bytes("broadcast", (t(4), 11), {}, ranks, 1) == [16, 0, 16, 16]
    assert call_peer_bytes("reduce", (t(4),), {"dst": 12}, ranks, 0) == [0, 0, 16, 0]
