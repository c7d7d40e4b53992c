"""The one launcher (experiments/launch/, placements in experiments/runner/launcher.py) and the tests' run_world
over it.

Here: the one-process checks. The topic's full description and its gloo-world checks are in
``tests/distributed/test_harness.py``.
"""

from __future__ import annotations

import signal
import subprocess

import pytest
import torch

from zeropp.experiments.launch import PlacementError, select_device
from zeropp.experiments.launch import world as launcher
from zeropp.experiments.runner.launcher import device_for_cluster, emulated_placement

# ---------------------------------------------------------------- launch_world: functions


def test_stop_signals_every_rank_before_continuing_any(monkeypatch):
    """The order itself (the world test in tests/distributed/test_harness.py may pass by luck of
    scheduling with either order): SIGTERM to each rank, then SIGCONT to each group, then torch's close, then SIGKILL."""
    sent: list[tuple[str, int, int]] = []
    monkeypatch.setattr(launcher.os, "kill", lambda pid, sig: sent.append(("kill", pid, sig)))
    monkeypatch.setattr(launcher.os, "killpg", lambda pid, sig: sent.append(("killpg", pid, sig)))
    monkeypatch.setattr(launcher, "_unreaped", lambda pid: pid != 13)  # 13: reaped, its number may be reused

    class _Context:
        def close(self, timeout: float) -> None:
            sent.append(("close", 0, 0))

    launcher._World(pc=_Context(), pids={0: 11, 1: 12, 2: 13}, log_dir=None, grace_s=1.0, ranks_per_node=None).stop()
    assert sent == [
        ("kill", 11, signal.SIGTERM),
        ("kill", 12, signal.SIGTERM),
        *[("killpg", p, signal.SIGCONT) for p in (11, 12, 13)],
        ("close", 0, 0),
        *[("killpg", p, signal.SIGKILL) for p in (11, 12, 13)],
    ]


def test_a_reaped_pid_is_not_ours_to_signal():
    child = subprocess.Popen(["true"])
    assert launcher._unreaped(child.pid)  # exited or not, it is ours until reaped
    child.wait()
    assert not launcher._unreaped(child.pid)


# ---------------------------------------------------------------- devices and placements


def test_select_device(monkeypatch):
    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert select_device("auto", 0, 1) == (torch.device("cpu"), "gloo")
    assert select_device("cpu", 1, 2) == (torch.device("cpu"), "gloo")
    with pytest.raises(RuntimeError, match=r"1 local process\(es\) but torch.cuda.device_count\(\)=0"):
        select_device("cuda", 0, 1)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert select_device("auto", 1, 2) == (torch.device("cuda", 1), "nccl") and chosen == [1]
    assert select_device("cpu", 1, 2) == (torch.device("cpu"), "gloo") and chosen == [1]
    assert select_device("auto", 3, 4) == (torch.device("cpu"), "gloo")  # 4 local processes, 2 GPUs
    with pytest.raises(RuntimeError, match=r"4 local process\(es\) but torch.cuda.device_count\(\)=2"):
        select_device("cuda", 3, 4)
    assert select_device("cuda", 0, 2) == (torch.device("cuda", 0), "nccl") and chosen == [1, 0]
    with pytest.raises(ValueError, match="launcher.device='gpu'"):
        select_device("gpu", 0, 1)
    with pytest.raises(ValueError, match="LOCAL_RANK=2 outside LOCAL_WORLD_SIZE=2"):
        select_device("auto", 2, 2)


def test_emulated_cluster_refuses_cuda_before_building_anything():
    assert device_for_cluster("cuda", "local") == "cuda" and device_for_cluster("auto", "local") == "auto"
    assert device_for_cluster("auto", "emulated") == "cpu" and device_for_cluster("cpu", "emulated") == "cpu"
    with pytest.raises(PlacementError, match="bypass the shaped links.*cluster=local"):
        device_for_cluster("cuda", "emulated")
    with pytest.raises(PlacementError, match="NCCL"), emulated_placement(4, 2, 1.0, 0.0, device="cuda"):
        pass
