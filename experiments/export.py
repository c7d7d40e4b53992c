"""``python -m experiments.export``: the documented command, an alias of :mod:`experiments.runner.export`
(where the code lives; this file only keeps the command).
"""

from __future__ import annotations

from .runner.export import cli, main

__all__ = ["cli", "main"]

if __name__ == "__main__":
    cli()
