"""``python -m experiments.scaling_check``: the documented command, an alias of :mod:`experiments.projection.scaling_check`
(where the code lives; this file only keeps the command). ``calibrate``, ``compare_measured`` and ``format_comparison`` are documented API.
"""

from __future__ import annotations

from .projection.scaling_check import calibrate, cli, compare_measured, format_comparison, main

__all__ = ["calibrate", "cli", "compare_measured", "format_comparison", "main"]

if __name__ == "__main__":
    cli()
