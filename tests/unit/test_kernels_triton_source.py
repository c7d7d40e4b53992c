"""Source rules for the Triton kernels that no CPU run can check.

The interpreter runs kernels as numpy, so a construct the GPU compiler lowers differently passes
every interpreter test. Seen on an H200 (Triton 3.6): unary minus on a float tile compiled as
``0 - x``, so the decoded code of -0.0 came out +0.0 and 72 format cases lost their sign bit.
The rule: no unary minus on a non-constant inside a ``@jit`` function (set the sign bit, or
subtract from an explicit operand where +0.0 is what is wanted).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parents[2] / "kernels"


def _jit_functions(tree: ast.Module) -> list[ast.FunctionDef]:
    def is_jit(d: ast.expr) -> bool:
        d = d.func if isinstance(d, ast.Call) else d
        return (isinstance(d, ast.Name) and d.id == "jit") or (isinstance(d, ast.Attribute) and d.attr == "jit")

    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and any(map(is_jit, n.decorator_list))]


def _negations(fn: ast.FunctionDef) -> list[int]:
    """Lines of ``-expr`` with a non-constant operand (``-1``, ``-(2**31)`` and ``-QMAX``, an
    upper-case ``tl.constexpr``, are fine: folded at compile time)."""

    def constant(e: ast.expr) -> bool:
        return all(
            isinstance(n, (ast.Constant, ast.BinOp, ast.operator, ast.UnaryOp, ast.unaryop, ast.Load))
            or (isinstance(n, ast.Name) and n.id.isupper())
            for n in ast.walk(e)
        )

    return [
        n.lineno
        for n in ast.walk(fn)
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub) and not constant(n.operand)
    ]


SOURCES = sorted(p for p in KERNELS.glob("*.py") if "jit" in p.read_text())


def test_the_rule_sees_the_jit_functions() -> None:
    """The scan is not vacuous: it finds the kernels and would flag a negation."""
    found = sum(len(_jit_functions(ast.parse(p.read_text()))) for p in SOURCES)
    assert found >= 20, found
    bad = ast.parse("@jit\ndef f(v):\n    return tl.where(v < 0, -v, v)\n")
    assert _negations(_jit_functions(bad)[0]) == [3]
    ok = ast.parse("@triton.jit\ndef f(v, QMAX: tl.constexpr):\n    return v * -1.0 + -(2**31) - -QMAX\n")
    assert _negations(_jit_functions(ok)[0]) == []


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_no_unary_minus_in_jit_code(path: Path) -> None:
    tree = ast.parse(path.read_text())
    bad = [(fn.name, line) for fn in _jit_functions(tree) for line in _negations(fn)]
    assert not bad, f"{path.name}: unary minus in @jit code at {bad}; set the sign bit instead (module docstring)"
