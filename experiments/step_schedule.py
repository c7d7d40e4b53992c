"""``python -m experiments.step_schedule``: the documented command, an alias of :mod:`experiments.projection.step_schedule`
(where the code lives; this file only keeps the command). ``project_scheduled`` is documented API.
"""

from __future__ import annotations

from .projection.step_schedule import cli, main, project_scheduled

__all__ = ["cli", "main", "project_scheduled"]

if __name__ == "__main__":
    cli()
