"""``tests/gpu/test_comm_nccl.py``'s own logic on gloo ranks (its CPU mode), so that the checks the
NCCL test makes (the references, the byte counts, the error bounds) are judged in CI and not first
on a rare machine with two or four GPUs."""

from __future__ import annotations

from pathlib import Path

import pytest

import tests.worlds  # noqa: F401  (the fork server's preload of torch and zeropp)
from tests.gpu.test_comm_nccl import run_spawned


@pytest.mark.parametrize("world", [2, 4])
def test_the_nccl_collectives_test_passes_on_gloo_ranks(world: int, tmp_path: Path) -> None:
    # forked from the preloaded fork server, as run_world's ranks: no import of torch per rank
    run_spawned(world, tmp_path, backend="gloo", start_method="forkserver")
