"""Structure of zeropp.runtime, read from the source with ``ast``: no module imports the engine
except the package ``__init__`` (imports under ``TYPE_CHECKING`` and inside functions count too).
Import cycles and private reach-ins are checked package-wide in tests/unit/test_imports.py."""

from __future__ import annotations

import ast
from pathlib import Path

import zeropp

ROOT = Path(zeropp.__file__).parent
PACKAGES = ("runtime", "models")


def _modules(pkg: str) -> dict[str, ast.Module]:
    return {f.stem: ast.parse(f.read_text(), str(f)) for f in sorted((ROOT / pkg).glob("*.py"))}


def _imports(pkg: str, mods: dict[str, ast.Module], name: str) -> set[str]:
    """Sibling modules of ``pkg`` that module ``name`` imports (anywhere in its body)."""
    out: set[str] = set()
    for node in ast.walk(mods[name]):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                base = node.module
            elif node.level == 0 and node.module and node.module.startswith(f"zeropp.{pkg}"):
                base = node.module[len(f"zeropp.{pkg}") :].lstrip(".") or None
            else:
                continue
            if base:
                out.add(base.split(".")[0])
            else:  # from . import x
                out.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith(f"zeropp.{pkg}."):
                    out.add(a.name.split(".")[2])
    return {m for m in out if m in mods and m != name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state and (c := visit(m)):
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (c := visit(n)):
            return c
    return None


def test_nothing_imports_the_engine():
    """The engine uses its collaborators; none of them uses the engine (cycles: tests/unit/test_imports.py)."""
    for pkg in PACKAGES:
        mods = _modules(pkg)
        graph = {m: _imports(pkg, mods, m) for m in mods if m != "__init__"}
        if pkg == "runtime":
            users = sorted(m for m, deps in graph.items() if "engine" in deps)
            assert users == [], f"modules importing engine.py: {users}"
            assert "checkpoint" in graph["engine"] and "stage3" in graph["engine"]  # the walker sees imports


def test_a_rank_that_never_checkpoints_does_not_import_dcp() -> None:
    """Importing the runtime and the runner's rank worker leaves ``torch.distributed.checkpoint``
    and DTensor (which pull in sympy: seconds of start-up in every rank) unimported until a
    checkpoint is saved, loaded or consolidated, or tensor parallelism is used; a fresh interpreter,
    since this test process may have imported them already."""
    import subprocess
    import sys

    code = (
        "import sys, zeropp.runtime as r, experiments.runner.worker\n"
        "assert r.CheckpointError.__name__ == 'CheckpointError'\n"
        "print(sorted(m for m in ('torch.distributed.checkpoint', 'torch.distributed.tensor', 'sympy') "
        "if m in sys.modules))\n"
        "r.export_consolidated\n"
        "print('torch.distributed.checkpoint' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["[]", "True"], out.stdout
