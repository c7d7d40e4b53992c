"""The blockwise Walsh-Hadamard rotation (``zeropp.kernels.hadamard``).

Here: the end-to-end checks. The topic's full description and its one-process checks are in
``tests/unit/test_kernels_hadamard.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from zeropp.kernels._triton import HAS_TRITON

pytestmark = [pytest.mark.usefixtures("one_torch_thread")]
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


_COMPILE = r"""
import re, struct, sys
from zeropp.kernels._triton import HAS_TRITON
if not HAS_TRITON:
    sys.exit(77)
try:
    from triton.backends.nvidia.compiler import get_ptxas
    get_ptxas(90).path
except Exception as exc:
    print(f"no ptxas for sm_90: {exc}")
    sys.exit(77)
from zeropp.kernels.compile_check import _compile_ptx
from zeropp.kernels.hadamard import _hadamard_kernel
from zeropp.kernels.reference import hadamard_scale
for dt, block, size in (("fp32", 2, "small"), ("bf16", 128, "large"), ("fp16", 512, "large"), ("bf16", 16384, "large")):
    consts = dict(GROUP_SIZE=block, LOG2_BLOCK=block.bit_length() - 1, SCALE=hadamard_scale(block))
    ptx = _compile_ptx(_hadamard_kernel, {"x_ptr": "*" + dt, "out_ptr": "*" + dt}, consts, 90, size)
    scale = "0f%08X" % struct.unpack("<I", struct.pack("<f", hadamard_scale(block)))[0]
    assert not re.search(r"\bfma\.", ptx), (dt, block, "fused multiply-add")
    assert scale in ptx, (dt, block, "the fp32 scale constant", scale)
    assert "mul.rn.f32" in ptx and "sub.rn.f32" in ptx, (dt, block, "IEEE fp32 arithmetic")
    print("ok", dt, block, size)
"""


@needs_triton
def test_kernel_compiles_for_h100_with_ieee_arithmetic() -> None:
    """The interpreter never runs the compiler: compile the kernel for sm_90 (Triton ships ptxas)
    and check the PTX keeps the reference's arithmetic: IEEE add / sub / mul, no fused
    multiply-add, the exact fp32 scale. Without TRITON_INTERPRET, hence the subprocess."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode == 77:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stdout + proc.stderr
