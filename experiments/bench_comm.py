"""``python -m experiments.bench_comm``: the documented command, an alias of :mod:`experiments.bench.comm`
(where the code lives; this file only keeps the command).
"""

from __future__ import annotations

from .bench.comm import cli, main

__all__ = ["cli", "main"]

if __name__ == "__main__":
    cli()
