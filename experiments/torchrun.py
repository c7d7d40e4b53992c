"""``python -m experiments.torchrun``: the documented command, an alias of :mod:`experiments.runner.torchrun`
(where the code lives; this file only keeps the command).
"""

from __future__ import annotations

from .runner.torchrun import cli, main

__all__ = ["cli", "main"]

if __name__ == "__main__":
    cli()
