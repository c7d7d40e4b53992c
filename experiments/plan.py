"""``python -m experiments.plan``: the documented command, an alias of :mod:`experiments.runner.plan`
(where the code lives; this file only keeps the command).
"""

from __future__ import annotations

import sys

from .runner.plan import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
