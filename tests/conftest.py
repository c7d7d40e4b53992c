"""Test-wide setup.

The tests live in four tiers, one folder each, cheapest first (``testpaths`` in pyproject.toml):
``unit/`` (one process, no child process), ``distributed/`` (gloo worlds of local processes),
``e2e/`` (programs in child processes: the runner's command line, sweeps, torchrun, the emulated
cluster, benchmarks, native kernel builds) and ``gpu/`` (the ``cuda`` tests). Each test
carries its folder's marker (:func:`pytest_collection_modifyitems`), so ``pytest -m "not e2e"``
works as well as ``pytest tests/unit``; every test of ``gpu/``, and only those, is marked ``cuda``.

Triton kernels on CPU tensors run under ``TRITON_INTERPRET=1``, which must be set before triton is
first imported, so that they can be checked against their torch references on a machine without
a GPU. The interpreter replaces the compiled kernels in the whole process, so it is turned on
only where it is needed (:func:`triton_interpreter`): never where a CUDA device is present (a
plain ``pytest`` there runs the ``cuda`` tests on the compiled kernels, and the interpreter-only
tests skip, see ``tests/triton_helpers.py``), and never when the selection asks for the ``cuda``
tests (``pytest -m cuda``), whatever the environment says.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from tests import cache_warmers

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

INTERPRET = "TRITON_INTERPRET"
TESTS = Path(__file__).resolve().parent
TIERS = ("unit", "distributed", "e2e", "gpu")
"""The tier folders under ``tests/``, cheapest first; each is also the marker of its tests."""
WORLD_TIERS = ("distributed", "e2e")
"""The tiers whose tests start worlds of processes. Under pytest-xdist with ``--dist loadgroup``
(README's test command) they are one work unit, :data:`WORLDS_GROUP` (:func:`pytest_xdist_make_scheduler`;
the modules of :data:`FREE_WORLD_MODULES` apart), run by one worker in their usual order while the other workers take the one-process unit tests:
the worlds keep the cores they were written against (their heartbeats, timeouts and interrupt
timings), and the unit tier, which leaves a core idle on its own, runs beside them instead of
before them."""
WORLDS_GROUP = "worlds"
FREE_WORLD_MODULES = frozenset(
    {
        "tests/distributed/test_experiments_training.py",
        "tests/distributed/test_models_hf.py",
        "tests/distributed/test_runtime_frozen.py",
        "tests/distributed/test_runtime_parity.py",
        "tests/distributed/test_runtime_tp.py",
        "tests/distributed/test_runtime_zero_r.py",
        "tests/e2e/test_hf_export.py",
    }
)
"""World modules that check results only (parity with a reference run, whole-world timeouts of
minutes, no timing of their own), the heaviest: under pytest-xdist each is a work unit of its own
(its module fixtures run once), free to run beside :data:`WORLDS_GROUP` on the worker that the unit
tier leaves idle at its end."""


def tier_of(path: Path) -> str | None:
    """The tier folder ``path`` lies in (None: outside every tier, e.g. a helper module)."""
    try:
        parts = path.resolve().relative_to(TESTS).parts
    except ValueError:
        return None
    return parts[0] if len(parts) > 1 and parts[0] in TIERS else None


def untiered_test_files(root: Path = TESTS) -> list[str]:
    """Test modules directly in ``tests/`` (outside every tier): ``testpaths`` would not collect
    them, so they are refused rather than silently skipped."""
    return sorted(p.name for p in root.glob("test_*.py"))


def pytest_sessionstart(session: pytest.Session) -> None:
    stray = untiered_test_files()
    if stray:
        raise pytest.UsageError(
            f"{', '.join('tests/' + n for n in stray)}: a test module outside the tiers is "
            f"never collected by `pytest`; move it into tests/{{{','.join(TIERS)}}}/ "
            "(unit: one process; distributed: run_world/launch_world; e2e: the runner's "
            "command line, torchrun, the cluster; gpu: needs CUDA)"
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with its tier folder, and ``cuda`` on every test of ``gpu/``; a ``cuda`` test
    elsewhere is refused, so that ``pytest -m cuda`` is exactly the GPU tier."""
    misplaced = []
    for item in items:
        tier = tier_of(item.path)
        if tier is not None:
            item.add_marker(tier)
        if tier == "gpu":
            item.add_marker("cuda")
        elif item.get_closest_marker("cuda") is not None:
            misplaced.append(item.nodeid)
    if misplaced:
        raise pytest.UsageError(
            f"marked cuda outside tests/gpu/ (move them there, so that `pytest -m cuda` "
            f"selects the GPU tier and nothing else): {', '.join(misplaced[:5])}"
            + (f" and {len(misplaced) - 5} more" if len(misplaced) > 5 else "")
        )


def scope_of(nodeid: str, fallback: Callable[[str], str]) -> str:
    """The xdist work unit of a test: its module for :data:`FREE_WORLD_MODULES`, :data:`WORLDS_GROUP`
    for the other world tests, ``fallback``'s (pytest-xdist's own ``loadgroup`` scope) for the rest."""
    module = nodeid.split("::", 1)[0]  # relative to the rootdir, the folder above tests/
    if module in FREE_WORLD_MODULES:
        return module
    if tier_of(TESTS.parent / module) in WORLD_TIERS:
        return WORLDS_GROUP
    return fallback(nodeid)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's: unknown where it is not installed
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With ``--dist loadgroup``: pytest-xdist's scheduler for it, with the world tiers as one work
    unit (:data:`WORLD_TIERS`). Done here, not with ``xdist_group`` marks: pytest 9.2's structured
    node ids drop the group suffix pytest-xdist 3.8 writes into them, so the marks group nothing
    (pytest-xdist issue 1386). The largest unit is handed out first, so the worlds start at once."""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class WorldsTogether(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid, super()._split_scope)

    return WorldsTogether(config, log)


_WARMERS = cache_warmers.Running()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the compile-cache warmers this selection is worth (``tests/cache_warmers.py``): not in
    an xdist worker or a collect-only session."""
    if session.config.option.collectonly or "PYTEST_XDIST_WORKER" in os.environ:
        return
    ids = [item.nodeid for item in session.items]
    tiers = [tier_of(item.path) for item in session.items]
    _WARMERS.start(cache_warmers.to_start(ids, tiers, os.environ.get(cache_warmers.ENV)))


def pytest_runtest_setup(item: pytest.Item) -> None:
    _WARMERS.wait_for(item.nodeid)


def pytest_sessionfinish(session: pytest.Session) -> None:
    _WARMERS.stop()


def selects_cuda(markexpr: str) -> bool:
    """Whether ``-m markexpr`` is a GPU session: it selects some test marked ``cuda`` and no test
    without that mark, whatever other marks the tests carry (``-m cuda``, ``-m "cuda and not
    slow"``). Every combination of the expression's other marks is tried with pytest's own
    parser of ``-m``; an expression it cannot parse is left to pytest to report (False here)."""
    if not markexpr.strip():
        return False
    from _pytest.mark.expression import Expression  # pytest's parser of -m (stable since pytest 6)

    names = sorted(set(re.findall(r"[\w.+-]+", markexpr)) - {"and", "or", "not", "cuda"})[:10]
    try:
        expr = Expression.compile(markexpr)

        def selected(cuda: bool, marks: tuple[bool, ...]) -> bool:
            on = {n for n, m in zip(names, marks) if m} | ({"cuda"} if cuda else set())
            return expr.evaluate(lambda name, **_: name in on)

        combos = list(itertools.product((False, True), repeat=len(names)))
        return any(selected(True, c) for c in combos) and not any(selected(False, c) for c in combos)
    except Exception:
        return False


def triton_interpreter(markexpr: str, cuda_available: bool, env: str | None) -> str | None:
    """The value ``TRITON_INTERPRET`` must have for this session (None: unset).

    ``pytest -m cuda`` (:func:`selects_cuda`): None, even if the caller exported it (the cuda tier
    exists to run the compiled kernels). A machine with a CUDA device: the caller's own setting,
    else None. A machine without one: the caller's setting, else ``"1"``."""
    if selects_cuda(markexpr):
        return None
    if cuda_available:
        return env
    return env if env is not None else "1"


def threads_per_worker(cores: int, workers: str | None, env: str | None) -> int | None:
    """The intra-op threads each pytest-xdist worker should use (None: leave torch's default).

    Without xdist (``workers`` is None) or when the caller set ``OMP_NUM_THREADS`` (``env``): None.
    Otherwise the cores shared out, at least one each: ``workers`` processes each running torch's
    default of one thread per core oversubscribe the machine, and OpenMP's waiting threads then make
    a large CPU reference (a tensor above torch's 32K-element grain, run on every core) thousands of
    times slower; on a 16-core GPU host 14 workers took 45-100 s per bit-exactness case."""
    if workers is None or env is not None:
        return None
    try:
        n = int(workers)
    except ValueError:
        return None
    return max(1, cores // max(1, n))


def pytest_configure(config: pytest.Config) -> None:
    threads = threads_per_worker(
        os.cpu_count() or 1, os.environ.get("PYTEST_XDIST_WORKER_COUNT"), os.environ.get("OMP_NUM_THREADS")
    )
    if threads is not None:
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # the worlds a test starts inherit it
    want = triton_interpreter(
        config.getoption("markexpr", default="") or "", torch.cuda.is_available(), os.environ.get(INTERPRET)
    )
    if want is None:
        os.environ.pop(INTERPRET, None)
    else:
        os.environ[INTERPRET] = want
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        # A test run started in the background by a script inherits Ctrl-C ignored, and so would
        # every command the interrupt tests start (Python installs no handler where SIGINT is
        # ignored at start-up): give this process Python's own handler, which the children's exec
        # resets to the default, as in an interactive shell.
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules of small single-process tensors: on the shared 2-core machine intra-op threads
    only add waiting (a parallel region waits for its slowest, often descheduled, thread).
    Use with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``; restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
