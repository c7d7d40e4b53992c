"""``python -m experiments.memory_study``: the documented command, an alias of :mod:`experiments.studies.memory_study`
(where the code lives; this file only keeps the command).
"""

from __future__ import annotations

from .studies.memory_study import cli, main

__all__ = ["cli", "main"]

if __name__ == "__main__":
    cli()
