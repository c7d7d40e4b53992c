"""``python -m experiments.ring_probe``: the documented command, an alias of :mod:`experiments.cluster.ring_probe`
(where the code lives; this file only keeps the command).
"""

from __future__ import annotations

from .cluster.ring_probe import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
