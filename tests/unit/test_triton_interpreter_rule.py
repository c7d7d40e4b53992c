"""Where the test session turns on the Triton interpreter (``conftest.triton_interpreter``).

The interpreter replaces the compiled kernels in the whole process, so a GPU session that had it
on would test the interpreter instead of the GPU. The rule, checked with a fake "CUDA available":
``pytest -m cuda`` never runs it; a machine with a CUDA device runs it only if the caller asked;
a machine without one runs it unless the caller set it otherwise.
"""

from __future__ import annotations

import os

import pytest

from tests.conftest import selects_cuda, triton_interpreter


@pytest.mark.parametrize(
    "markexpr, gpu_session",
    [
        ("cuda", True),
        (" cuda ", True),
        ("cuda and not slow", True),
        ("slow and cuda", True),
        ("not slow and cuda", True),
        ("", False),
        ("not cuda", False),
        ("cuda or not slow", False),
        ("slow", False),
        ("notcuda", False),
        ("cuda and", False),  # malformed: pytest reports it, the rule does not guess
    ],
)
def test_selects_cuda_reads_the_marker_expression(markexpr, gpu_session):
    assert selects_cuda(markexpr) is gpu_session


@pytest.mark.parametrize(
    "markexpr, cuda_available, env, want",
    [
        ("cuda", True, None, None),
        ("cuda", True, "1", None),
        ("cuda", False, "1", None),  # the cuda tier: never
        ("", True, None, None),  # a plain pytest on a GPU machine: compiled kernels
        ("", True, "1", "1"),  # ... unless the caller asks for the interpreter
        ("", False, None, "1"),
        ("not cuda", False, None, "1"),  # no GPU: the interpreter
        ("", False, "0", "0"),  # the caller's own setting is kept
    ],
)
def test_the_interpreter_only_where_no_cuda_device_is(markexpr, cuda_available, env, want):
    assert triton_interpreter(markexpr, cuda_available, env) == want


def test_this_session_follows_the_rule():
    """The running session applied the rule to its own selection and machine (here: CPU-only, so
    the interpreter is on, which the interpreter-only kernel tests need)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this check is for the CPU tier; the GPU tier runs without the interpreter")
    assert os.environ.get("TRITON_INTERPRET") == "1"
