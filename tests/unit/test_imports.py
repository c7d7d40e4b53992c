"""The house's floors: no import cycle anywhere, and each floor imports only downward.

Walks the source of every module of the installed ``zeropp`` package (``zeropp.kernels`` and
``zeropp.experiments`` included) with ``ast``, counting every import statement wherever it sits
(module level, inside functions, under ``if TYPE_CHECKING:``): a cycle that only a deferred import
hides is still two modules that cannot be understood apart.
"""

from __future__ import annotations

import ast
import importlib.util
import pkgutil
from pathlib import Path

import zeropp

FLOORS = ("zeropp.kernels", "zeropp", "zeropp.experiments")
"""Lowest first. A module may import its own floor or a lower one."""


def _modules() -> dict[str, Path]:
    """Every module of the zeropp distribution -> its source file."""
    out: dict[str, Path] = {}
    pkgs = ["zeropp", "zeropp.kernels", "zeropp.experiments"]
    while pkgs:
        name = pkgs.pop()
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.submodule_search_locations, name
        out[name] = Path(spec.origin)  # type: ignore[arg-type]
        for info in pkgutil.iter_modules(spec.submodule_search_locations):
            full = f"{name}.{info.name}"
            if info.ispkg:
                pkgs.append(full)
            else:
                s = importlib.util.find_spec(full)
                assert s is not None and s.origin
                out[full] = Path(s.origin)
    return out


def _resolve(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, is_pkg, node)
                targets = [f"{base}.{a.name}" for a in node.names]  # a name, or a submodule of base
            for t in targets:
                # the deepest module of ours that the name refers to (a package's __init__ counts)
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    graph[mod].add(t)
    return graph


def _floor(mod: str) -> int:
    return max(i for i, f in enumerate(FLOORS) if mod == f or mod.startswith(f + "."))


def test_no_import_cycles() -> None:
    edges = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t) :] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_floors_import_only_downward() -> None:
    bad = [(m, t) for m, ts in _graph().items() for t in ts if _floor(t) > _floor(m)]
    assert not bad, "upward imports: " + ", ".join(f"{m} -> {t}" for m, t in bad)


def test_one_spelling_of_the_kernels_import() -> None:
    """Inside zeropp, the kernels are ``zeropp.kernels`` (never a relative ``..kernels``)."""
    root = Path(zeropp.__file__).parent
    bad = [
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if "from ..kernels" in p.read_text() or "from ...kernels" in p.read_text()
    ]
    assert not bad, bad


EXTERNAL = {"os", "sys", "torch"}
"""Modules not of this project whose private names we may use (``os._exit``, ``torch._C``)."""


def test_no_private_attribute_reach_ins() -> None:
    """Collaborators talk through public attributes: no ``obj._private`` on anything but ``self`` /
    ``cls`` (or an external module) in zeropp and experiments."""
    bad = []
    for mod, path in _modules().items():
        if mod.startswith("zeropp.kernels"):
            continue  # the kernels floor's compile check reads its sibling kernels on purpose
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                root = node.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    continue
                if isinstance(root, ast.Name) and root.id in EXTERNAL:
                    continue
                bad.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "\n".join(bad)
