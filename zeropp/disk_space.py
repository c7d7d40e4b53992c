"""Free space on a filesystem: what this process may still write there, and what ``df`` shows.

``statvfs`` reports two counts of free blocks: ``f_bfree``, every free block, and ``f_bavail``,
the free blocks an unprivileged process may take; ``df``'s Avail column is ``f_bavail`` whoever runs
it. They differ on ext2/3/4, which keeps a share of its blocks (``tune2fs -m``, 5 % by default)
for the reserve's owner. The kernel (``ext4_has_free_clusters``) lets a process write into that
reserve only if its fsuid is the filesystem's ``resuid``, or ``resgid`` is not 0 and the process is
in group ``resgid``, or it holds ``CAP_SYS_RESOURCE`` in the host's user namespace. Root qualifies
by its user ID only while ``resuid`` is the default 0: a mount with ``resuid=65534`` gives root the
reserve only through the capability. :func:`free_space` gives both numbers and decides, by that
rule, which one this process may use.

ext4 also keeps clusters of its own (``s_resv_clusters``, ``/sys/fs/ext4/<dev>/reserved_clusters``,
at most 4096 by default) out of ``f_bavail`` but inside ``f_bfree``; no process may write them, so
they are subtracted from what a privileged process may use. They count in clusters, which are blocks
unless the filesystem was made with ``bigalloc`` (its cluster size is in the superblock only, not
readable without the device); on such a filesystem the subtraction counts too little by the
cluster ratio, a few MiB at most at the default reserve.

Anything this module cannot read (no ``/proc``, a user namespace of its own, no sysfs entry of an
ext3/ext4 filesystem) leaves ``f_bavail``, the lower count, which is never more than the process
may write. Other filesystems whose two counts differ (btrfs: data it cannot place) grant no
privilege over the difference.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

RESERVING_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4"})
"""Filesystem types whose ``f_bfree - f_bavail`` is a reserve that its owner (``resuid`` /
``resgid``, root by default) may write into."""

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


@dataclass(frozen=True, kw_only=True)
class Mount:
    """The mount of a filesystem as ``/proc/self/mountinfo`` lists it."""

    device: str
    """Its device as ``major:minor``."""

    fstype: str
    """Its type (``ext4``, ``tmpfs``, ...)."""

    super_options: tuple[str, ...]
    """Its superblock's options (``resuid=65534``, ...): the line's last field, split at commas."""

    def option(self, name: str) -> str | None:
        """The value of the superblock option ``name=value``; None where it is not listed."""
        prefix = f"{name}="
        return next((o[len(prefix) :] for o in self.super_options if o.startswith(prefix)), None)


def parse_mountinfo(text: str, device: str) -> Mount | None:
    """The first mount of ``device`` (``major:minor``) in the text of ``/proc/self/mountinfo``."""
    for line in text.splitlines():
        fields = line.split()
        # id parent major:minor root mountpoint options [optional...] - fstype source superoptions
        if len(fields) > 2 and fields[2] == device and "-" in fields:
            rest = fields[fields.index("-") + 1 :]
            if rest:
                return Mount(
                    device=device, fstype=rest[0], super_options=tuple(rest[2].split(",")) if len(rest) > 2 else ()
                )
    return None


def mount_of(path: str | Path) -> Mount | None:
    """The mount of the filesystem holding ``path``; None where that cannot be read (not Linux)."""
    try:
        dev = os.stat(path).st_dev
        text = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return None
    return parse_mountinfo(text, f"{os.major(dev)}:{os.minor(dev)}")


def filesystem_type(path: str | Path) -> str | None:
    """The type of the filesystem holding ``path`` (``ext4``, ``tmpfs``, ...); None where that cannot
    be read (not Linux)."""
    mount = mount_of(path)
    return None if mount is None else mount.fstype


@dataclass(frozen=True, kw_only=True)
class Credentials:
    """What the kernel checks before letting a process write into an ext reserve."""

    fsuid: int
    """The filesystem user ID (``/proc/self/status``'s ``Uid:`` fourth field)."""

    groups: frozenset[int]
    """The filesystem group ID and the supplementary groups."""

    cap_sys_resource: bool
    """Whether ``CAP_SYS_RESOURCE`` is in the effective set."""

    host_namespace: bool
    """Whether the IDs are the host's (the kernel compares the reserve's owner and the capability in
    the initial user namespace; a namespace of its own cannot be mapped back here, so counts as not)."""


def parse_status(status: str, *, host_namespace: bool, groups: frozenset[int] = frozenset()) -> Credentials | None:
    """Credentials from the text of ``/proc/self/status`` (its ``Uid:``, ``Gid:``, ``Groups:`` and
    ``CapEff:`` lines) plus ``groups``; None where a line is missing or malformed."""
    lines = {k: v.split() for k, _, v in (ln.partition(":") for ln in status.splitlines())}
    try:
        fsuid, fsgid = int(lines["Uid"][3]), int(lines["Gid"][3])
        extra = {int(g) for g in lines.get("Groups", [])}
        cap = int(lines["CapEff"][0], 16) >> CAP_SYS_RESOURCE & 1
    except (KeyError, IndexError, ValueError):
        return None
    return Credentials(
        fsuid=fsuid,
        groups=frozenset({fsgid, *extra, *groups}),
        cap_sys_resource=bool(cap),
        host_namespace=host_namespace,
    )


def _in_initial_user_namespace() -> bool:
    try:
        first = Path("/proc/self/uid_map").read_text().split()
    except OSError:
        return False
    return first[:3] == ["0", "0", "4294967295"]


def credentials() -> Credentials | None:
    """This process's credentials; None where ``/proc/self/status`` cannot be read."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    return parse_status(
        status, host_namespace=_in_initial_user_namespace(), groups=frozenset({os.getegid(), *os.getgroups()})
    )


def may_use_reserved_blocks(mount: Mount, creds: Credentials | None) -> bool:
    """Whether the kernel lets a process with ``creds`` write into the reserve of ``mount``, an ext
    filesystem: its fsuid is ``resuid``, or ``resgid`` is not 0 and it is in that group, or it holds
    ``CAP_SYS_RESOURCE`` (``resuid`` / ``resgid`` default to 0 where the mount does not list them).
    False where anything is unknown: no credentials, IDs of a user namespace of its own, an option
    that is not a number."""
    if creds is None or not creds.host_namespace:
        return False
    try:
        resuid, resgid = int(mount.option("resuid") or 0), int(mount.option("resgid") or 0)
    except ValueError:
        return False
    return creds.fsuid == resuid or (resgid != 0 and resgid in creds.groups) or creds.cap_sys_resource


def ext4_reserved_clusters(mount: Mount) -> int | None:
    """ext4's own reserved clusters (``/sys/fs/ext4/<dev>/reserved_clusters``), which no process may
    write; 0 on ext2 mounted by its own driver (no such entry, no such reserve); None where unknown."""
    try:
        name = Path(os.readlink(f"/sys/dev/block/{mount.device}")).name
    except OSError:
        return None
    try:
        return int(Path(f"/sys/fs/ext4/{name}/reserved_clusters").read_text())
    except FileNotFoundError:
        return 0 if mount.fstype == "ext2" and not Path(f"/sys/fs/ext4/{name}").exists() else None
    except (OSError, ValueError):
        return None


def free_space(path: str | Path) -> FreeSpace:
    """The free space of the filesystem holding ``path`` (see the module's docstring)."""
    st = os.statvfs(path)
    shown = st.f_bavail * st.f_frsize
    if st.f_bfree <= st.f_bavail:
        return FreeSpace(usable=shown, shown=shown)
    mount = mount_of(path)
    if mount is None or mount.fstype not in RESERVING_FILESYSTEMS or not may_use_reserved_blocks(mount, credentials()):
        return FreeSpace(usable=shown, shown=shown)
    own = ext4_reserved_clusters(mount)
    if own is None:
        return FreeSpace(usable=shown, shown=shown)
    usable = max(st.f_bfree - own, st.f_bavail) * st.f_frsize
    return FreeSpace(usable=usable, shown=shown)
