"""The top level of ``experiments/`` keeps every documented ``python -m experiments.X`` command while
the code lives in rooms: each alias runs exactly what its room module runs as ``__main__`` and
exports that module's own objects; the paths the runner computes from its new place (the worker
module its launcher starts, the YAML config tree) still name what exists."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pkgutil
from pathlib import Path

import pytest

import zeropp.experiments as top
from zeropp.experiments.runner import run
from zeropp.experiments.runner.config import CONF_DIR
from zeropp.experiments.runner.launcher import worker_module

ROOMS = ("runner", "projection", "cluster", "bench", "studies", "launch")


def _aliases() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(top.__path__) if not m.ispkg)


def _main_guard(path: Path) -> str:
    """The statements under ``if __name__ == "__main__":`` of a module, as source."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'":
            return "\n".join(ast.unparse(s) for s in node.body)
    raise AssertionError(f"{path}: no __main__ guard")


def test_the_documented_entry_points_are_all_there() -> None:
    assert _aliases() == sorted(
        [
            "bench_cluster",
            "bench_comm",
            "bench_fsdp",
            "bench_gpu",
            "bench_kernels",
            "bench_offload",
            "bench_peers",
            "converge",
            "export",
            "formats",
            "memory",
            "memory_study",
            "mixz",
            "plan",
            "report",
            "ring_probe",
            "run",
            "scaling",
            "scaling_check",
            "step_schedule",
            "torchrun",
        ]
    )


@pytest.mark.parametrize("name", _aliases())
def test_alias_runs_what_its_room_module_runs(name: str) -> None:
    alias = importlib.import_module(f"zeropp.experiments.{name}")
    tree = ast.parse(Path(alias.__file__).read_text())  # type: ignore[arg-type]
    sources = [n.module for n in tree.body if isinstance(n, ast.ImportFrom) and n.level == 1]
    assert len(sources) == 1 and sources[0] and sources[0].split(".")[0] in ROOMS, sources
    room = importlib.import_module(f"zeropp.experiments.{sources[0]}")
    assert _main_guard(Path(alias.__file__)) == _main_guard(Path(room.__file__))  # type: ignore[arg-type]
    assert alias.__all__ and all(getattr(alias, n) is getattr(room, n) for n in alias.__all__)


@pytest.mark.parametrize("package", [None, "zeropp.experiments.runner", "experiments.runner", run.__package__])
def test_the_launcher_starts_a_worker_module_that_exists(package: str | None) -> None:
    """The runner passes its own package (``runner/run.py``'s); a stale default would start ranks
    that die at once with ``No module named ...``."""
    name = worker_module(package)
    assert name.endswith(".runner.worker")
    assert importlib.util.find_spec(name) is not None, name


def test_the_runner_finds_its_yaml_config_tree() -> None:
    assert (CONF_DIR / "config.yaml").is_file() and (CONF_DIR / "sweep").is_dir(), CONF_DIR
