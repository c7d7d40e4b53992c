"""The Triton kernels against the torch reference, bit for bit, on CPU tensors under
TRITON_INTERPRET=1.

Here: the end-to-end checks. The topic's full description and its one-process checks are in
``tests/unit/test_kernels_triton.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.triton_helpers import interpreted
from zeropp.kernels._triton import HAS_TRITON

pytestmark = [
    pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed"),
    interpreted,
    pytest.mark.usefixtures("one_torch_thread"),
]


# ---------------------------------------------------------------------------------------------
def test_kernels_compile_for_h100_without_fp_contraction_or_ftz():
    """The interpreter skips the compiler, so GPU-only errors (a non-constexpr global, a type
    mismatch) would otherwise surface only on a GPU. kernels/compile_check.py compiles every kernel
    for sm_90 with the launchers' options and checks the PTX keeps the bit-exact arithmetic (no
    fused multiply-add, IEEE division without flush-to-zero). It must run without
    TRITON_INTERPRET (which replaces triton.jit), hence the subprocess."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "zeropp.kernels.compile_check"], env=env, capture_output=True, text=True, timeout=300
    )
    if proc.returncode == 77:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stdout + proc.stderr
