"""The test tiers (``tests/conftest.py``, ``testpaths`` in pyproject.toml): each test is marked with
its folder, only ``tests/gpu/`` holds ``cuda`` tests, the tiers run cheapest first, and the paths
other tools name (``scripts/gpu_check.sh``) exist."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from tests import conftest
from tests.conftest import TESTS, TIERS, tier_of, untiered_test_files

ROOT = TESTS.parent


def test_tier_of_reads_the_folder_under_tests() -> None:
    for tier in TIERS:
        assert tier_of(TESTS / tier / "test_x.py") == tier
    assert tier_of(TESTS / "worlds.py") is None  # a helper module: no tier
    assert tier_of(TESTS / "data" / "readme_collectives.py") is None
    assert tier_of(ROOT / "zeropp" / "launch.py") is None  # outside tests/
    assert tier_of(TESTS / "unit") is None  # the folder itself is not a test module in it


def test_every_test_module_is_in_a_tier(tmp_path: Path) -> None:
    assert untiered_test_files() == []  # this checkout
    (tmp_path / "test_stray.py").write_text("")
    (tmp_path / "stray_helpers.py").write_text("")
    (tmp_path / "unit").mkdir()
    (tmp_path / "unit" / "test_placed.py").write_text("")
    assert untiered_test_files(tmp_path) == ["test_stray.py"]
    for tier in TIERS:
        assert (TESTS / tier / "__init__.py").is_file(), tier  # importable: spawned ranks unpickle by module name


class _Item:
    """The part of a pytest Item the collection hook uses."""

    def __init__(self, path: Path, *marks: str) -> None:
        self.path, self.nodeid, self.marks = path, str(path.relative_to(ROOT)) + "::test_x", set(marks)

    def add_marker(self, name: str) -> None:
        self.marks.add(name)

    def get_closest_marker(self, name: str) -> object | None:
        return name if name in self.marks else None


def test_each_test_gets_its_folder_marker_and_gpu_tests_are_cuda() -> None:
    items = [_Item(TESTS / t / "test_x.py") for t in TIERS]
    conftest.pytest_collection_modifyitems(None, items)  # type: ignore[arg-type]
    assert [sorted(i.marks) for i in items] == [["unit"], ["distributed"], ["e2e"], ["cuda", "gpu"]]


def test_under_xdist_the_world_tiers_are_one_work_unit_and_the_rest_keep_xdists_scopes() -> None:
    """README's ``-n 2 --dist loadgroup``: every distributed and e2e test in one unit (one worker, in
    order), a unit or gpu test in pytest-xdist's own scope (here: the fallback's)."""
    own = "own:{}".format
    g = conftest.WORLDS_GROUP
    assert conftest.scope_of("tests/distributed/test_a.py::test_x[2]", own) == g
    assert conftest.scope_of("tests/e2e/test_b.py::TestC::test_y", own) == g
    assert conftest.scope_of("tests/unit/test_c.py::test_z", own) == "own:tests/unit/test_c.py::test_z"
    assert conftest.scope_of("tests/gpu/test_d.py::test_w", own) == "own:tests/gpu/test_d.py::test_w"
    assert conftest.scope_of("tests/unit/test_e2e.py::test_v", own) == "own:tests/unit/test_e2e.py::test_v"
    free = "tests/distributed/test_runtime_parity.py"
    assert conftest.scope_of(f"{free}::test_stages[s3]", own) == free  # one unit per module: its fixtures run once
    for module in conftest.FREE_WORLD_MODULES:
        assert (ROOT / module).is_file() and conftest.tier_of(ROOT / module) in conftest.WORLD_TIERS, module


def test_a_cuda_test_outside_the_gpu_tier_is_refused() -> None:
    items = [_Item(TESTS / "gpu" / "test_a.py", "cuda"), _Item(TESTS / "distributed" / "test_b.py", "cuda")]
    with pytest.raises(pytest.UsageError, match=r"marked cuda outside tests/gpu/.*tests/distributed/test_b.py::test_x"):
        conftest.pytest_collection_modifyitems(None, items)  # type: ignore[arg-type]


def test_testpaths_run_the_tiers_cheapest_first_and_markers_are_registered() -> None:
    opts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert opts["testpaths"] == [f"tests/{t}" for t in TIERS]
    registered = {m.split(":")[0] for m in opts["markers"]}
    assert registered >= {*TIERS, "cuda"}


def test_the_gpu_check_names_modules_that_exist() -> None:
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    (first,) = re.findall(r"^FIRST_MODULES=\((.*?)\)$", script, flags=re.M | re.S)
    (body,) = re.findall(r"^PARALLEL_MODULES=\((.*?)\)$", script, flags=re.M | re.S)
    (alone,) = re.findall(r"^ALONE_FIRST=\((.*?)\)$", script, flags=re.M | re.S)
    modules = first.split() + alone.split() + body.split()
    assert "tests/gpu/test_runtime_local_group_cuda.py" in alone.split(), alone  # not yet proven on a GPU
    assert "tests/gpu/test_kernels_formats_cuda.py" in first.split(), first  # not yet proven on a GPU
    assert len(modules) >= 6 and len(set(modules)) == len(modules), modules
    for module in modules:
        assert (ROOT / module).is_file(), module
        assert tier_of(ROOT / module) == "gpu", module
