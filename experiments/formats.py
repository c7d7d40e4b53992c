"""``python -m experiments.formats``: the documented command, an alias of :mod:`experiments.studies.formats`
(where the code lives; this file only keeps the command).
"""

from __future__ import annotations

from .studies.formats import cli, main

__all__ = ["cli", "main"]

if __name__ == "__main__":
    cli()
