"""``python -m experiments.report``: the documented command, an alias of :mod:`experiments.studies.report`
(where the code lives; this file only keeps the command).
"""

from __future__ import annotations

from .studies.report import cli, main

__all__ = ["cli", "main"]

if __name__ == "__main__":
    cli()
