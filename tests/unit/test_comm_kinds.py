"""One spelling of every communication kind: ``zeropp.comm.kinds.CommKind``.

The engine's and the plug-ins' kinds (the ``CommStats`` keys a step records) are written as string
literals nowhere but in their declaration, so ``grep CommKind.FWD_ALL_GATHER`` finds every use. The
generic kinds (``all_gather``, ``checkpoint``...) double as algorithm, stream and summary names, so
only the distinctive ones are checked.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import zeropp
from zeropp.comm.kinds import CommKind
from zeropp.runtime import plan_kinds

DISTINCT = {
    CommKind.FWD_ALL_GATHER,
    CommKind.BWD_ALL_GATHER,
    CommKind.FROZEN_ALL_GATHER,
    CommKind.GRAD_REDUCE_SCATTER,
    CommKind.GRAD_ALL_REDUCE,
    CommKind.PARAM_ALL_GATHER,
    CommKind.WEIGHT_DIFF_ALL_GATHER,
    CommKind.DDP_ALL_REDUCE,
    CommKind.FSDP_ALL_GATHER,
    CommKind.FSDP_REDUCE_SCATTER,
}


def _sources() -> list[Path]:
    roots = [Path(zeropp.__file__).parent]
    for name in ("zeropp.experiments", "zeropp.kernels"):
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.submodule_search_locations
        roots += [Path(p) for p in spec.submodule_search_locations]
    return sorted({p.resolve() for r in roots for p in r.rglob("*.py")})


def test_engine_kinds_are_spelled_once() -> None:
    declaration = Path(zeropp.comm.kinds.__file__).resolve()
    values = {k.value for k in DISTINCT}
    bad = []
    for path in _sources():
        if path == declaration:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in values:
                bad.append(f"{path}:{node.lineno}: {node.value!r}")
    assert not bad, "write CommKind members instead of:\n" + "\n".join(bad)


def test_the_plan_vocabulary_re_exports_the_one_declaration() -> None:
    assert plan_kinds.CommKind is CommKind
