"""``python -m experiments.converge``: the documented command, an alias of :mod:`experiments.studies.converge`
(where the code lives; this file only keeps the command).
"""

from __future__ import annotations

import sys

from .studies.converge import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
