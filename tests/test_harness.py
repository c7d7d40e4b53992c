"""The multi-process harness itself: results come back by rank, and a failing rank fails fast."""

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_world


def _sum_ranks(rank: int, world: int) -> float:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _raise_on_one(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # rank 0 would wait here forever without the harness's kill


def test_results_by_rank():
    assert run_world(_sum_ranks, 3) == [3.0, 3.0, 3.0]


def test_failing_rank_reports_its_error_without_hanging():
    with pytest.raises(AssertionError, match="boom on rank 1"):
        run_world(_raise_on_one, 2, timeout=60)
