"""Free space as this process may use it: ``f_bavail`` for a normal user, ``f_bfree`` less ext4's own
reserved clusters for the owner of an ext2/3/4 reserve (the kernel's rule: resuid, resgid or
CAP_SYS_RESOURCE), and ``df``'s Avail column named in every refusal.

``statvfs`` is faked (the reserve of a real disk cannot be set up cheaply); the filesystem type is
read for real where the test runs."""

from __future__ import annotations

import dataclasses
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
ROOT = disk_space.Credentials(fsuid=0, groups=frozenset({0}), cap_sys_resource=False, host_namespace=True)
USER = disk_space.Credentials(fsuid=1000, groups=frozenset({1000}), cap_sys_resource=False, host_namespace=True)

# this host's kind of mount: the reserve belongs to nobody (65534), not to root
HOST_MOUNTINFO = "27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard,resv_strict,resuid=65534,resgid=65534\n"
HOST_STATUS = "Uid:\t0\t0\t0\t0\nGid:\t0\t0\t0\t0\nGroups:\t \nCapEff:\t000001fffeffffff\n"


def _mount(fstype: str = "ext4", options: str = "rw") -> disk_space.Mount:
    return disk_space.Mount(device="254:0", fstype=fstype, super_options=tuple(options.split(",")))


def _fake_statvfs(
    monkeypatch, *, bfree: int, bavail: int, fstype: str | None, privileged: bool, own_reserve: int | None = 0
) -> None:
    """statvfs gives ``bfree`` / ``bavail``; the mount is of ``fstype`` with the default reserve owner
    (root), and this process is root (``privileged``) or a normal user."""
    monkeypatch.setattr(
        disk_space.os, "statvfs", lambda path: SimpleNamespace(f_bfree=bfree, f_bavail=bavail, f_frsize=FRSIZE)
    )
    monkeypatch.setattr(disk_space, "mount_of", lambda path: None if fstype is None else _mount(fstype))
    monkeypatch.setattr(disk_space, "credentials", lambda: ROOT if privileged else USER)
    monkeypatch.setattr(disk_space, "ext4_reserved_clusters", lambda mount: own_reserve)


@pytest.mark.parametrize(
    "fstype, privileged, own_reserve, usable_blocks",
    [
        ("ext4", True, 0, 1000),  # root writes into the reserve
        ("ext4", True, 50, 950),  # but not into ext4's own reserved clusters
        ("ext4", True, None, 600),  # those unknown: what df shows
        ("ext4", False, 0, 600),  # a normal user: what df shows
        ("btrfs", True, 0, 600),  # no reserve of root's: the difference is not root's to use
        (None, True, 0, 600),  # unknown filesystem: the lower count
    ],
)
def test_free_space_counts_the_reserve_only_where_this_process_may_use_it(
    monkeypatch, fstype, privileged, own_reserve, usable_blocks
) -> None:
    _fake_statvfs(monkeypatch, bfree=1000, bavail=600, fstype=fstype, privileged=privileged, own_reserve=own_reserve)
    space = disk_space.free_space("/anywhere")
    assert space.usable == usable_blocks * FRSIZE
    assert space.shown == 600 * FRSIZE  # df's Avail, whoever asks


def test_root_gets_no_reserve_owned_by_another_user_without_cap_sys_resource(monkeypatch) -> None:
    """This host's case: ext4 mounted resuid=65534,resgid=65534, root in the host's namespace
    without CAP_SYS_RESOURCE; the kernel refuses the reserve, so the usable space is df's Avail."""
    mount = disk_space.parse_mountinfo(HOST_MOUNTINFO, "254:0")
    assert mount is not None and mount.option("resuid") == "65534"
    creds = disk_space.parse_status(HOST_STATUS, host_namespace=True)
    assert creds == disk_space.Credentials(fsuid=0, groups=frozenset({0}), cap_sys_resource=False, host_namespace=True)
    assert not disk_space.may_use_reserved_blocks(mount, creds)
    monkeypatch.setattr(
        disk_space.os, "statvfs", lambda path: SimpleNamespace(f_bfree=1000, f_bavail=600, f_frsize=FRSIZE)
    )
    monkeypatch.setattr(disk_space, "mount_of", lambda path: mount)
    monkeypatch.setattr(disk_space, "credentials", lambda: creds)
    monkeypatch.setattr(disk_space, "ext4_reserved_clusters", lambda mount: 0)
    assert disk_space.free_space("/").usable == 600 * FRSIZE


@pytest.mark.parametrize(
    "options, creds, allowed",
    [
        ("rw", ROOT, True),  # the default owner is root
        ("rw", USER, False),
        ("rw,resuid=65534,resgid=65534", ROOT, False),  # this host: root is not the owner
        ("rw,resuid=65534", dataclasses.replace(ROOT, cap_sys_resource=True), True),  # the capability
        ("rw,resuid=1000", USER, True),  # the owner by fsuid
        ("rw,resgid=1000", dataclasses.replace(USER, fsuid=2000), True),  # by group
        ("rw,resgid=0", dataclasses.replace(USER, groups=frozenset({0})), False),  # group 0 grants nothing
        ("rw", dataclasses.replace(ROOT, host_namespace=False), False),  # root of its own namespace
        ("rw,resuid=x", ROOT, False),  # an option not understood: conservative
        ("rw", None, False),  # credentials unknown
    ],
)
def test_the_reserve_is_granted_by_the_kernels_rule(options, creds, allowed) -> None:
    assert disk_space.may_use_reserved_blocks(_mount(options=options), creds) is allowed


def test_the_filesystem_type_is_read_for_real() -> None:
    assert disk_space.filesystem_type("/proc") == "proc"
    if Path("/dev/shm").is_dir():
        assert disk_space.filesystem_type("/dev/shm") == "tmpfs"


def test_this_process_credentials_are_read_for_real() -> None:
    creds = disk_space.credentials()
    assert creds is not None
    assert creds.fsuid == os.geteuid()  # fsuid follows euid unless setfsuid was called
    assert os.getegid() in creds.groups and set(os.getgroups()) <= creds.groups
    status = Path("/proc/self/status").read_text()
    cap_eff = int(next(ln for ln in status.splitlines() if ln.startswith("CapEff:")).split()[1], 16)
    assert creds.cap_sys_resource is bool(cap_eff & (1 << 24))


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
