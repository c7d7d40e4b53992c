"""The float formats' Triton kernels against their torch reference, bit for bit, on CPU tensors
under TRITON_INTERPRET=1: the 17 rows of 257 elements (17 programs per launch, about 2 s per
format in the interpreter). The topic's description and its cheap checks are in
``tests/unit/test_kernels_formats_triton.py``; the sm_90 compile of these kernels is
``tests/e2e/test_kernels_triton.py``'s compile check.
"""

from __future__ import annotations

import pytest

from tests.format_kernel_helpers import SCHEME_CASES, check_case
from tests.kernel_helpers import DTYPES
from tests.triton_helpers import interpreted
from zeropp.kernels._triton import HAS_TRITON

pytestmark = [
    pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed"),
    interpreted,
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter"),
]


@pytest.mark.parametrize("i", range(len(SCHEME_CASES)), ids=[str(c) for c in SCHEME_CASES])
def test_seventeen_rows_bit_exact(i):
    """17 rows of 257: every row ends inside a block, Philox offsets run over 17 padded rows;
    rounding alternates between nearest and stochastic over the formats, dtypes rotate."""
    scheme, elem, rule, gs = SCHEME_CASES[i]
    check_case(scheme, elem, rule, gs, (17, 257), 17, DTYPES[i % 3], stochastic=bool(i % 2))
