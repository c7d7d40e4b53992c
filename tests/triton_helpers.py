"""Marks for tests that run the Triton kernels on CPU tensors.

Such a test needs the interpreter (``TRITON_INTERPRET=1``), which ``conftest.py`` turns on only
on a machine without a CUDA device (see ``conftest.triton_interpreter``). On a GPU machine a plain
``pytest`` leaves it off, so that the ``cuda`` tests run the compiled kernels, and these tests
skip with the reason instead of failing in ``kernels._triton.check_launchable``.
"""

from __future__ import annotations

import os

import pytest

interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs Triton kernels on CPU tensors, which needs TRITON_INTERPRET=1; conftest.py sets it only "
    "where no CUDA device is present (there the cuda tests run the compiled kernels)",
)
"""Skip unless the Triton interpreter is on (read when the test module is imported, after
``conftest.pytest_configure`` has decided)."""
