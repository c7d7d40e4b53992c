"""``python -m experiments.export``: the documented command, an alias of :mod:`experiments.runner.export`
(where the code lives; this file only keeps the command).
"""

from __future__ import annotations

from .runner.export import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
