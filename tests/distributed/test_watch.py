"""The rank <-> launcher channel (zeropp/watch.py) with real ranks: a rank's error is never hidden
by a scratch directory the launcher cannot clean up, and a rank in a native call that holds the
interpreter lock is not called stopped.

Here: the gloo-world checks of this topic; its other tiers' checks are in ``tests/unit/test_watch.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from zeropp import watch

# ---------------------------------------------------------------- scratch


def _record_unlistable_scratch_then_fail(rank: int, world: int, afile: str) -> None:
    watch.scratch_prefix(afile, "swap", rank)  # recorded; by the end of the world its root is not a directory
    raise RuntimeError("the rank's own error")


def test_a_cleanup_problem_never_hides_the_ranks_error(tmp_path: Path):
    from zeropp.experiments.launch import RankFailure, launch_world

    afile = tmp_path / "afile"
    afile.write_text("mine")
    with (
        pytest.warns(RuntimeWarning, match="could not look for zeropp-swap-"),
        pytest.raises(RankFailure, match="the rank's own error"),
    ):
        launch_world(_record_unlistable_scratch_then_fail, 1, args=(str(afile),), timeout_s=60, grace_s=1.0)
    assert afile.read_text() == "mine"


def _hold_the_interpreter_lock(rank: int, world: int) -> None:
    import ctypes
    import time

    watch.heartbeat("work")
    time.sleep(0.5)  # the beat is published
    ctypes.PyDLL(None).sleep(30)  # libc sleep(3) through PyDLL: a native call that keeps the GIL


def test_a_native_call_holding_the_interpreter_lock_is_not_called_stopped():
    """The heartbeat thread of a running process goes silent when a native call keeps the GIL:
    the rank is named, with its real state (sleeping, not stopped)."""
    from zeropp.experiments.launch import RankFailure, launch_world

    with pytest.raises(RankFailure) as e:
        launch_world(_hold_the_interpreter_lock, 1, timeout_s=60, grace_s=1.0, heartbeat_s=2)
    msg = str(e.value)
    assert msg.startswith("rank 0 made no progress for 2 s (last seen: phase work"), msg
    assert "its process is alive (state S (sleeping)) but its heartbeat thread is silent" in msg, msg
