"""How many torch threads each pytest-xdist worker takes (``conftest.threads_per_worker``)."""

from __future__ import annotations

import pytest

from tests.conftest import threads_per_worker


@pytest.mark.parametrize(
    "cores, workers, env, want",
    [
        (16, None, None, None),  # no xdist: torch's default
        (16, "14", None, 1),  # 14 workers on 16 cores: one thread each
        (16, "4", None, 4),
        (16, "3", None, 5),  # rounded down: never more threads than cores
        (2, "8", None, 1),  # more workers than cores: still one
        (16, "4", "2", None),  # the caller's OMP_NUM_THREADS wins
        (16, "0", None, 16),
        (16, "many", None, None),  # not a count: leave it
    ],
)
def test_threads_per_worker(cores, workers, env, want) -> None:
    assert threads_per_worker(cores, workers, env) == want
