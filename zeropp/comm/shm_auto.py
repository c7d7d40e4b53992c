"""Whether a group may carry its plain collectives through shared memory: the agreed answer behind
``transport='auto'`` (``ZeroConfig.transport``).

The shared-memory transport (``shm.py``) works when every member of the group is a CPU rank on one
host and the host's ``/dev/shm`` has room for the region. Each member can judge only its own side
(its device, its ``/dev/shm``); a group whose members judged apart would split, some issuing
shared-memory uses while others issue the backend's collectives, and both would wait for ever (or
until the timeout). So :func:`shm_ability` is collective: each member states its own verdict as a
small code, one control all-reduce hands every member all of them, and every member derives the
same answer from the same codes, naming the first member that cannot and why (in words made from
the codes alone, so the reason too is the same on every member). The engine asks it of the whole
run, not the ZeRO group alone: with tensor parallelism several ZeRO groups each make a region on
the host, so every member counts the room of all of them and every group resolves alike.

What it cannot see (members on several hosts or in separate containers whose ``/dev/shm`` differ
while each has room) the region's set-up finds: rank 0's token is not in the others' memory, and
every member raises the same :class:`~.shm_sync.ShmError` at the same point. The owner of an
``auto`` choice catches that agreed error and keeps the backend (:class:`TransportChoice` records
why; ``shm_choice.py``), so that path is agreed too.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from typing import Optional

import torch
import torch.distributed as dist

from . import shm
from .backend import control_all_reduce, exchange_device
from .shm import DEFAULT_REGION_BYTES
from .shm_choice import TransportChoice
from .stats import group_ranks

__all__ = ["ShmAbility", "TransportChoice", "shm_ability"]


class _Verdict(enum.IntEnum):
    """One member's own verdict (sent as a number: larger codes name the likelier cause first)."""

    able = 0
    no_room = 1
    no_directory = 2
    not_cpu = 3
    several_nodes = 4


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShmAbility:
    """Every member's same answer from :func:`shm_ability`."""

    able: bool
    """Whether every member can take part in the group's shared-memory region."""
    reason: str
    """Why (a phrase for a log line): the members and host when able, else the first member that
    cannot and what it lacks."""


def shm_ability(
    group: Optional[dist.ProcessGroup],
    *,
    device: torch.device,
    nodes: int,
    regions: int = 1,
    directory: Optional[str] = None,
    need: int = DEFAULT_REGION_BYTES,
) -> ShmAbility:
    """Collective over ``group`` (None: the default group; every member calls it at the same point):
    whether the plain collectives of the ZeRO groups among its members can go through regions of
    shared memory under ``directory``: every member a CPU rank (``device``: where its model runs)
    of a ZeRO group on one node (``nodes``: the nodes the member's ZeRO group spans), with
    ``directory`` (None: :data:`~.shm.SHM_DIR`, read at the call) present, writable and holding
    room for ``regions`` regions of ``need`` bytes (every ZeRO group on the host makes one; asked
    over the default group, all members judge the same total, so no group takes the room another
    counted on). A group of one member is never able (no exchange is made then). The exchange
    runs on the group's backend device, whatever ``device`` is."""
    directory = shm.SHM_DIR if directory is None else directory
    ranks = group_ranks(group)
    W = len(ranks)
    if W < 2:
        return ShmAbility(able=False, reason="one rank: nothing to exchange")
    total = need * regions
    verdict, free = _own_verdict(device, nodes, directory, total)
    table = torch.zeros(W, 3, dtype=torch.int64, device=exchange_device(group))  # [W, (verdict, free MiB, nodes)]
    me = ranks.index(dist.get_rank())
    table[me] = torch.tensor([int(verdict), free >> 20, nodes], dtype=torch.int64)
    control_all_reduce(table, "sum", group)  # each row written by its member only: the sum is every row
    rows = [tuple(int(x) for x in row) for row in table.tolist()]
    worst = max(range(W), key=lambda i: (rows[i][0], -i))  # the first member with the likeliest cause
    code, free_mib, member_nodes = rows[worst]
    if code == _Verdict.able:
        return ShmAbility(able=True, reason=f"{W} CPU ranks on one host with room for the region")
    who = f"rank {ranks[worst]}"
    room = f"the region needs {need >> 20} MiB" if regions == 1 else f"{regions} regions need {total >> 20} MiB"
    why = {
        _Verdict.no_room: f"{who} has {free_mib} MiB free for shared memory, {room}",
        _Verdict.no_directory: f"{who} cannot write to its shared-memory directory",
        _Verdict.not_cpu: f"{who} runs on a GPU (NCCL has its own shared-memory paths)",
        _Verdict.several_nodes: f"the ZeRO group of {who} spans {member_nodes} nodes",
    }[_Verdict(code)]
    return ShmAbility(able=False, reason=why)


def _own_verdict(device: torch.device, nodes: int, directory: str, need: int) -> tuple[_Verdict, int]:
    """This member's verdict and the bytes free under ``directory`` (0 when not looked at)."""
    if nodes > 1:
        return _Verdict.several_nodes, 0
    if device.type != "cpu":
        return _Verdict.not_cpu, 0
    try:
        st = os.statvfs(directory)
    except OSError:
        return _Verdict.no_directory, 0
    if not os.access(directory, os.W_OK | os.X_OK):
        return _Verdict.no_directory, 0
    free = st.f_bavail * st.f_frsize
    return (_Verdict.able if free >= need else _Verdict.no_room), free
