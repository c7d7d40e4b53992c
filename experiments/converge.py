"""``python -m experiments.converge``: the documented command, an alias of :mod:`experiments.studies.converge`
(where the code lives; this file only keeps the command).
"""

from __future__ import annotations

from .studies.converge import cli, main

__all__ = ["cli", "main"]

if __name__ == "__main__":
    cli()
