"""Free space on a filesystem: what this process may still write there, and what ``df`` shows.

``statvfs`` reports two counts of free blocks: ``f_bfree``, every free block, and ``f_bavail``,
the free blocks an unprivileged process may take; ``df``'s Avail column is ``f_bavail`` whoever runs
it. They differ on ext2/3/4, which keeps a share of its blocks (``tune2fs -m``, 5 % by default)
for its reserved user (root unless ``tune2fs -u`` named another) and for any process holding
``CAP_SYS_RESOURCE``: the kernel lets those write into the reserve. A check against ``f_bavail``
alone refuses, as root, a run that fits; one against ``f_bfree`` alone promises a normal user room
it cannot have. :func:`free_space` gives both numbers and decides which one this process may use.

Other filesystems whose two counts differ (btrfs: data it cannot place) grant no privilege over
the difference, and one this module cannot identify (no ``/proc``) is taken at ``f_bavail``, the
lower count, which is never more than the process may write.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

RESERVING_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4"})
"""Filesystem types whose ``f_bfree - f_bavail`` is a reserve that root may write into."""

CAP_SYS_RESOURCE = 24
"""The capability's bit in ``/proc/self/status``'s ``CapEff`` mask (``linux/capability.h``)."""


@dataclass(frozen=True, kw_only=True)
class FreeSpace:
    """The free space of one filesystem, in bytes."""

    usable: int
    """What this process may still write there: ``shown`` plus the reserved blocks where it may
    write into them (see :func:`may_use_reserved_blocks`)."""

    shown: int
    """What ``df`` shows in its Avail column (``f_bavail``): the free space of an unprivileged user."""

    def __post_init__(self) -> None:
        if not 0 <= self.shown <= self.usable:
            raise ValueError(f"FreeSpace: need 0 <= shown <= usable, got shown={self.shown}, usable={self.usable}")

    @property
    def reserved(self) -> int:
        """The reserved bytes this process may use beyond what ``df`` shows (0 for most)."""
        return self.usable - self.shown


def filesystem_type(path: str | Path) -> str | None:
    """The type of the filesystem holding ``path`` (``ext4``, ``tmpfs``, ...), from the mount of the
    same device in ``/proc/self/mountinfo``; None where that cannot be read (not Linux)."""
    try:
        dev = os.stat(path).st_dev
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    want = f"{os.major(dev)}:{os.minor(dev)}"
    for line in lines:
        fields = line.split()
        # id parent major:minor root mountpoint options [optional...] - fstype source superoptions
        if len(fields) > 2 and fields[2] == want and "-" in fields:
            rest = fields[fields.index("-") + 1 :]
            if rest:
                return rest[0]
    return None


def _in_initial_user_namespace() -> bool:
    """Whether this process's user IDs are the host's: the kernel checks the reserve's user and
    capability against the initial namespace, so a container's root in its own namespace is not
    privileged there."""
    try:
        first = Path("/proc/self/uid_map").read_text().split()
    except OSError:
        return False
    return first[:3] == ["0", "0", "4294967295"]


def _has_cap_sys_resource() -> bool:
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> CAP_SYS_RESOURCE & 1)
    return False


def may_use_reserved_blocks() -> bool:
    """Whether the kernel lets this process write into an ext filesystem's reserved blocks: it runs
    as root (the reserve's default user) or holds ``CAP_SYS_RESOURCE``, both in the host's user
    namespace. A container's root holds no ``CAP_SYS_RESOURCE`` by default but is still root."""
    if not _in_initial_user_namespace():
        return False
    return os.geteuid() == 0 or _has_cap_sys_resource()


def free_space(path: str | Path) -> FreeSpace:
    """The free space of the filesystem holding ``path`` (see the module's docstring)."""
    st = os.statvfs(path)
    shown = st.f_bavail * st.f_frsize
    usable = shown
    if st.f_bfree > st.f_bavail and filesystem_type(path) in RESERVING_FILESYSTEMS and may_use_reserved_blocks():
        usable = st.f_bfree * st.f_frsize
    return FreeSpace(usable=usable, shown=shown)
