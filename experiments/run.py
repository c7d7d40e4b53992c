"""``python -m experiments.run``: the documented command, an alias of :mod:`experiments.runner.run`
(where the code lives; this file only keeps the command). ``run_job`` is the documented Python entry (one job, as the command line runs it).
"""

from __future__ import annotations

from .runner.run import cli, run_job

__all__ = ["cli", "run_job"]

if __name__ == "__main__":
    cli()
