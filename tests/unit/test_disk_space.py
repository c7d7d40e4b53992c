"""Free space as this process may use it: ``f_bavail`` for a normal user, ``f_bfree`` (the reserved
blocks too) for root on ext2/3/4, and ``df``'s Avail column named in every refusal.

``statvfs`` is faked (the reserve of a real disk cannot be set up cheaply); the filesystem type is
read for real where the test runs."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.experiment_helpers import composed_config
from zeropp import disk_space
from zeropp.experiments.runner import preflight
from zeropp.experiments.runner.config import ConfigError, from_dict
from zeropp.experiments.runner.console import human_bytes

FRSIZE = 4096


def _fake_statvfs(monkeypatch, *, bfree: int, bavail: int, fstype: str, privileged: bool) -> None:
    monkeypatch.setattr(
        disk_space.os, "statvfs", lambda path: SimpleNamespace(f_bfree=bfree, f_bavail=bavail, f_frsize=FRSIZE)
    )
    monkeypatch.setattr(disk_space, "filesystem_type", lambda path: fstype)
    monkeypatch.setattr(disk_space, "may_use_reserved_blocks", lambda: privileged)


@pytest.mark.parametrize(
    "fstype, privileged, usable_blocks",
    [
        ("ext4", True, 1000),  # root writes into the reserve
        ("ext4", False, 600),  # a normal user: what df shows
        ("btrfs", True, 600),  # no reserve of root's: the difference is not root's to use
        (None, True, 600),  # unknown filesystem: the lower count
    ],
)
def test_free_space_counts_the_reserve_only_where_this_process_may_use_it(
    monkeypatch, fstype, privileged, usable_blocks
) -> None:
    _fake_statvfs(monkeypatch, bfree=1000, bavail=600, fstype=fstype, privileged=privileged)
    space = disk_space.free_space("/anywhere")
    assert space.usable == usable_blocks * FRSIZE
    assert space.shown == 600 * FRSIZE  # df's Avail, whoever asks


def test_the_filesystem_type_is_read_for_real() -> None:
    assert disk_space.filesystem_type("/proc") == "proc"
    if Path("/dev/shm").is_dir():
        assert disk_space.filesystem_type("/dev/shm") == "tmpfs"


def test_root_is_privileged_over_the_reserve_only_in_the_hosts_user_namespace() -> None:
    host_ns = Path("/proc/self/uid_map").read_text().split()[:3] == ["0", "0", "4294967295"]
    status = Path("/proc/self/status").read_text()
    cap_eff = int(next(ln for ln in status.splitlines() if ln.startswith("CapEff:")).split()[1], 16)
    expected = host_ns and (os.geteuid() == 0 or bool(cap_eff & (1 << 24)))
    assert disk_space.may_use_reserved_blocks() is expected


def _nvme_run(tmp_path: Path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    rc = from_dict(
        composed_config(
            "model=small", "stage=3", "zero.offload_optimizer=nvme", "zero.offload_param=nvme", f"zero.nvme_path={nvme}"
        )
    )
    need = preflight.model_state_per_rank(rc)["disk"] * rc.topology.world_size
    return rc, int(need) // FRSIZE + 1  # blocks that hold the swap files


def test_root_may_use_the_reserved_blocks_for_the_nvme_swap_files(tmp_path, monkeypatch) -> None:
    """The swap files fit in the free blocks but not in df's Avail: root (reserved blocks usable) is
    let through, a normal user is refused, and the refusal names what df shows."""
    rc, blocks = _nvme_run(tmp_path)
    _fake_statvfs(monkeypatch, bfree=blocks, bavail=blocks // 2, fstype="ext4", privileged=True)
    preflight.check_nvme_space(rc, rc.topology.world_size)  # fits: no error
    _fake_statvfs(monkeypatch, bfree=blocks, bavail=blocks // 2, fstype="ext4", privileged=False)
    with pytest.raises(ConfigError, match=f"has {human_bytes(blocks // 2 * FRSIZE)} free but"):
        preflight.check_nvme_space(rc, rc.topology.world_size)


def test_a_refusal_as_root_names_dfs_avail_beside_the_reserve(tmp_path, monkeypatch) -> None:
    rc, blocks = _nvme_run(tmp_path)
    _fake_statvfs(monkeypatch, bfree=blocks - 2, bavail=blocks // 2, fstype="ext4", privileged=True)
    with pytest.raises(ConfigError) as e:
        preflight.check_nvme_space(rc, rc.topology.world_size)
    line = str(e.value)
    assert f"{human_bytes((blocks - 2) * FRSIZE)} free to this process" in line, line
    assert f"{human_bytes(blocks // 2 * FRSIZE)} in df's Avail column" in line, line
    assert "\n" not in line


def test_an_output_folder_is_full_only_when_this_process_cannot_write(tmp_path, monkeypatch) -> None:
    floor = preflight.MIN_OUTPUT_FREE // FRSIZE
    _fake_statvfs(monkeypatch, bfree=floor, bavail=0, fstype="ext4", privileged=True)
    preflight.check_writable_dir("train.checkpoint_dir", tmp_path)  # root writes into the reserve
    _fake_statvfs(monkeypatch, bfree=floor, bavail=0, fstype="ext4", privileged=False)
    with pytest.raises(ConfigError, match=r"is on a full disk \(0 B free at"):
        preflight.check_writable_dir("train.checkpoint_dir", tmp_path)
