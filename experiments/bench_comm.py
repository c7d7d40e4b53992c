"""``python -m experiments.bench_comm``: the documented command, an alias of :mod:`experiments.bench.comm`
(where the code lives; this file only keeps the command).
"""

from __future__ import annotations

import sys

from .bench.comm import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
