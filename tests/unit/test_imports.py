"""The house's floors: no import cycle anywhere, and each floor imports only downward; inside
the harness, each room imports only the rooms its row of :data:`ROOMS` names.

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


ROOMS: dict[str, frozenset[str]] = {
    "launch": frozenset(),
    "projection": frozenset({"launch"}),
    "cluster": frozenset({"projection"}),
    "runner": frozenset({"projection", "cluster", "launch"}),
    "bench": frozenset({"runner", "projection", "cluster", "launch"}),
    "studies": frozenset({"runner", "projection", "launch"}),
}
"""The harness's rooms (``zeropp.experiments.<room>``) -> the other rooms it may import. The
projection imports no room but the launcher (its calibration starts a gloo world); nothing imports
``bench`` or ``studies``; no room imports the top level (``zeropp.experiments`` and its aliases)."""

TOP = "zeropp.experiments"


def _room(mod: str) -> str | None:
    """The room of a harness module; None for the top level (the package and its aliases)."""
    parts = mod.split(".")
    return parts[2] if len(parts) > 3 or (len(parts) == 3 and parts[2] in ROOMS) else None


def forbidden_room_edges(graph: dict[str, set[str]]) -> list[str]:
    """Each import between harness modules that :data:`ROOMS` does not allow, as ``a -> b (why)``."""
    bad = []
    for m, ts in graph.items():
        if not (m == TOP or m.startswith(TOP + ".")):
            continue
        src = _room(m)
        if src is not None and src not in ROOMS:
            bad.append(f"{m}: room {src!r} is not in ROOMS; add its row (the rooms it may import)")
            continue
        for t in ts:
            if not (t == TOP or t.startswith(TOP + ".")) or src is None:
                continue  # the library, or an alias (the top level may import every room)
            dst = _room(t)
            if dst is None:
                bad.append(f"{m} -> {t} (a room imports the top level; import the room's module instead)")
            elif dst != src and dst not in ROOMS[src]:
                bad.append(f"{m} -> {t} ({src} may import only {sorted(ROOMS[src]) or 'no other room'})")
    return bad


def test_rooms_import_only_what_their_row_allows() -> None:
    bad = forbidden_room_edges(_graph())
    assert not bad, "imports between rooms that ROOMS does not allow:\n" + "\n".join(bad)


def test_the_room_check_refuses_a_forbidden_edge() -> None:
    """The check itself fails on each kind of forbidden edge (so the test above can fail)."""
    graph = {
        f"{TOP}.projection.scaling": {f"{TOP}.runner.config", "zeropp.comm"},
        f"{TOP}.runner.run": {f"{TOP}.studies.report", f"{TOP}.projection.scaling", f"{TOP}.launch"},
        f"{TOP}.bench.cluster": {f"{TOP}.run"},
        f"{TOP}.attic.old": set(),
        f"{TOP}.run": {f"{TOP}.runner.run"},
    }
    bad = forbidden_room_edges(graph)
    assert bad == [
        f"{TOP}.projection.scaling -> {TOP}.runner.config (projection may import only ['launch'])",
        f"{TOP}.runner.run -> {TOP}.studies.report (runner may import only ['cluster', 'launch', 'projection'])",
        f"{TOP}.bench.cluster -> {TOP}.run (a room imports the top level; import the room's module instead)",
        f"{TOP}.attic.old: room 'attic' is not in ROOMS; add its row (the rooms it may import)",
    ], bad


def _alias_statement(node: ast.stmt) -> bool:
    """Whether ``node`` is one of an alias's other statements: its docstring, the ``__future__``
    or ``sys`` import, ``__all__``, or a one-line ``__main__`` guard."""
    if isinstance(node, ast.Expr):
        return isinstance(node.value, ast.Constant)
    if isinstance(node, ast.ImportFrom):
        return node.module == "__future__"
    if isinstance(node, ast.Import):
        return [a.name for a in node.names] == ["sys"]
    if isinstance(node, ast.Assign):
        return [ast.unparse(x) for x in node.targets] == ["__all__"]
    if isinstance(node, ast.If):
        return ast.unparse(node.test) == "__name__ == '__main__'" and len(node.body) == 1 and not node.orelse
    return False


def test_every_room_exists_and_the_top_level_holds_only_aliases() -> None:
    """Each room of the table is a package; a module at the top level is a thin alias: a
    docstring, imports of one room module, ``__all__`` and a ``__main__`` guard, nothing else (new
    code goes into a room)."""
    mods = _modules()
    assert {m.split(".")[2] for m in mods if m.startswith(TOP + ".") and _room(m)} == set(ROOMS)
    bad = []
    for mod, path in mods.items():
        if not mod.startswith(TOP + ".") or _room(mod) is not None:
            continue
        tree = ast.parse(path.read_text())
        sources = set()
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                sources.add(node.module)
            elif not _alias_statement(node):
                bad.append(f"{path}:{node.lineno}: {ast.unparse(node).splitlines()[0]}")
        if len(sources) != 1 or _room(f"{TOP}.{sources.pop()}") is None:
            bad.append(f"{path}: an alias imports from exactly one room module")
    assert not bad, "the top level of experiments/ holds aliases only; move code into a room:\n" + "\n".join(bad)


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
