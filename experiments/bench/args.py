"""What the benchmark command lines (``bench_gpu``, ``bench_fsdp``, ``bench_cluster``, ``bench_peers``)
share: argument checks, each refusing a count below its floor with argparse's usage error (exit
status 2) and naming the flag as the user typed it, and the order of interleaved rounds."""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence


def flag(name: str) -> str:
    """The command-line spelling of argparse destination ``name`` (``micro_batch`` -> ``--micro-batch``)."""
    return "--" + name.replace("_", "-")


def require_at_least(p: argparse.ArgumentParser, a: argparse.Namespace, names: Iterable[str], low: int) -> None:
    """``p.error`` (exit 2) for the first of ``names`` whose parsed value is below ``low``."""
    for name in names:
        value = getattr(a, name)
        if value < low:
            p.error(f"{flag(name)} must be >= {low}, got {value}")


def check_run_lengths(p: argparse.ArgumentParser, a: argparse.Namespace, counts: Iterable[str]) -> None:
    """The checks every benchmark makes: each of ``counts`` (steps, batch sizes, ...) >= 1, and
    ``--warmup`` >= 0."""
    require_at_least(p, a, counts, 1)
    require_at_least(p, a, ("warmup",), 0)


def round_order(keys: Sequence[str], r: int) -> list[str]:
    """The rows of round ``r`` (from 0): ``keys`` rotated by ``r``, so each row takes each place in turn."""
    k = r % len(keys) if keys else 0
    return [*keys[k:], *keys[:k]]
