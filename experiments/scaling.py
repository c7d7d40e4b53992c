"""``python -m experiments.scaling``: the documented command, an alias of :mod:`experiments.projection.speedup`
(where the code lives; this file only keeps the command).
"""

from __future__ import annotations

from .projection.speedup import cli, main

__all__ = ["cli", "main"]

if __name__ == "__main__":
    cli()
