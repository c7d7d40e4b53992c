"""``python -m experiments.bench_offload``: the documented command, an alias of :mod:`experiments.bench.offload`
(where the code lives; this file only keeps the command).
"""

from __future__ import annotations

from .bench.offload import cli, main, parse_args

__all__ = ["cli", "main", "parse_args"]

if __name__ == "__main__":
    cli()
