"""The scaling cost model: exact message sizes, and the ZeRO++ paper's direction and size.

Here: the end-to-end checks. The topic's full description and its one-process checks are in
``tests/unit/test_scaling.py``.
"""

from __future__ import annotations


def test_scaling_does_not_import_its_check() -> None:
    """scaling_check imports scaling, never the other way round (no import cycle)."""
    import subprocess
    import sys

    code = "import sys, zeropp.experiments.projection.scaling; print('zeropp.experiments.projection.scaling_check' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]
