"""Compile caches filled in the background while the unit tier runs.

Two groups of e2e tests spend most of their time in compilers whose output is cached on disk:
the compiled CPU kernels (``tests/e2e/test_kernels.py``'s ``compiled`` tests: some 45 inductor
graphs, about 110 CPU-seconds from a cold cache, 25 from a warm one) and the Triton compile check
(``tests/e2e/test_kernels_triton.py``: every kernel compiled for sm_90, about 45 CPU-seconds cold,
3 warm). On a fresh CI machine both caches are cold. The unit tier, which runs first, is one
process of small single-threaded tests and leaves the second core mostly idle, so a session that
holds unit tests and one of those groups first starts a child ``pytest`` of that group at the
lowest CPU priority: its results are thrown away, but by the time the session reaches the group
the compilers' caches (torch inductor's and Triton's, where the child and the session both look)
hold what the tests compile. The tests themselves are unchanged: they compile, run and compare
as before, and a cache miss (the child slower, or failing) only costs the cold time. The child
never sees a selection of its own (``ENV`` set: no warmers in it) and is stopped when the session
ends. ``ZEROPP_TEST_WARMERS=0`` turns the warmers off.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ENV = "ZEROPP_TEST_WARMERS"
"""``0``: no warmers in this session (set to ``0`` in each warmer's own child session, too)."""

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, kw_only=True)
class Warmer:
    """One group of tests whose compile cache a child session fills."""

    name: str
    """What it warms, for messages."""
    file: str
    """The test module, relative to the repository root."""
    keyword: str | None = None
    """A ``-k`` expression selecting the group's tests in ``file`` (None: the whole module)."""

    def matches(self, nodeid: str) -> bool:
        """Whether the test ``nodeid`` is one of this group's (``keyword`` as a plain substring
        of the test's name, which is how the group's ``-k`` expression selects it)."""
        path, _, name = nodeid.partition("::")
        return path == self.file and (self.keyword is None or self.keyword in name)

    def argv(self, basetemp: Path) -> list[str]:
        """The child ``pytest`` that runs the group (quiet, its own temporary folder)."""
        k = ["-k", self.keyword] if self.keyword else []
        return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={basetemp}", self.file, *k]


WARMERS = (
    Warmer(name="inductor (the compiled CPU kernels)", file="tests/e2e/test_kernels.py", keyword="compiled"),
    Warmer(name="Triton (the sm_90 compile check)", file="tests/e2e/test_kernels_triton.py", keyword="compile"),
)


def to_start(nodeids: list[str], tiers: list[str | None], env: str | None) -> list[Warmer]:
    """The warmers worth starting for a session that runs ``nodeids`` (in order; ``tiers``: each
    one's tier folder): those whose group is selected and comes after some unit test (which runs
    first and leaves a core idle). None when ``env`` is ``"0"`` (turned off, or a warmer's own
    child session). A group run alone would only race its own warmer for the same compiles."""
    if env == "0" or "unit" not in tiers:
        return []
    first_unit = tiers.index("unit")
    return [w for w in WARMERS if any(w.matches(n) for n in nodeids[first_unit + 1 :])]


@dataclass
class Running:
    """The warmers started for this session: stopped (with their children) and their temporary
    folders removed by :meth:`stop`."""

    warmers: list[Warmer] = field(default_factory=list)
    procs: list[subprocess.Popen] = field(default_factory=list)
    temps: list[Path] = field(default_factory=list)

    def start(self, warmers: list[Warmer]) -> None:
        env = {**os.environ, ENV: "0"}
        for w in warmers:
            tmp = Path(tempfile.mkdtemp(prefix="zeropp-warm-"))
            self.temps.append(tmp)
            p = subprocess.Popen(
                w.argv(tmp / "pytest"),
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # its own group: stop() reaches the compilers it started
            )
            try:
                os.setpriority(os.PRIO_PROCESS, p.pid, 19)  # idle CPU only; its children inherit it
            except OSError:
                pass
            self.warmers.append(w)
            self.procs.append(p)

    def wait_for(self, nodeid: str, timeout: float = 600) -> None:
        """Before a test of a warmed group: a warmer of that group still running gets normal
        priority and is waited for (``timeout`` s, then stopped), so that the test reads what it
        compiled instead of compiling the same graphs beside it."""
        for w, p in zip(self.warmers, self.procs):
            if p.poll() is None and w.matches(nodeid):
                try:
                    os.setpriority(os.PRIO_PGRP, p.pid, 0)
                except OSError:
                    pass
                try:
                    p.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait()
        for tmp in self.temps:
            shutil.rmtree(tmp, ignore_errors=True)
        self.warmers.clear()
        self.procs.clear()
        self.temps.clear()
