"""The shared-memory transport's synchronisation (``zeropp.comm.shm_sync.FlagSync``), in one
process over an anonymous shared mapping: a wait returns when the peer's counter reaches the use
(set from another thread, as a peer process would), raises at once naming a peer whose process
exited, and raises at the deadline naming a peer that never arrives; never a hang."""

from __future__ import annotations

import mmap
import os
import subprocess
import threading
import time

import numpy as np
import pytest

from zeropp.comm import shm_sync
from zeropp.comm.shm_sync import FlagSync, flag_offset, header_bytes

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not shm_sync.flags_usable(), reason="the futex counters are used on x86-64 Linux only"),
]


def _sync(pids: list[int], timeout_s: float = 30.0) -> tuple[FlagSync, np.ndarray, mmap.mmap]:
    mm = mmap.mmap(-1, header_bytes(len(pids)))
    words = np.frombuffer(mm, dtype=np.int32)
    return FlagSync(mm, world=len(pids), rank=0, ranks=[0, 1], pids=pids, timeout_s=timeout_s), words, mm


def test_a_wait_returns_once_the_peer_published_the_use():
    sync, words, _mm = _sync([os.getpid(), os.getpid()])
    wait = sync.start(1, 77)
    assert words[flag_offset(0) // 4] == 1  # this member's counter, where its peers read it

    def peer() -> None:
        time.sleep(0.2)
        words[flag_offset(1) // 4 + 1 + 1] = 77  # the peer's descriptor of use 1, then its counter
        words[flag_offset(1) // 4] = 1
        sync._futex(1, 1, 0x7FFFFFFF, None)  # the peer's FUTEX_WAKE

    t = threading.Thread(target=peer)
    start = time.monotonic()
    t.start()
    wait()
    t.join()
    assert 0.15 < time.monotonic() - start < 5
    words[flag_offset(1) // 4 + 1 + 0] = 78  # the peer's use 2, then it moved on to use 3
    words[flag_offset(1) // 4] = 3  # a peer one use ahead counts; its use-2 descriptor is still there
    sync.start(2, 78)()


def test_a_peer_at_another_collective_raises_naming_it():
    sync, words, _mm = _sync([os.getpid(), os.getpid()])
    words[flag_offset(1) // 4 + 1 + 1] = shm_sync.describe("reduce_scatter", "float32", 4, 0, 4)
    words[flag_offset(1) // 4] = 1
    with pytest.raises(shm_sync.ShmError, match=r"rank 1 issued another shared-memory collective than rank 0"):
        sync.start(1, shm_sync.describe("all_gather", "float32", 4, 0, 4))()


def test_peers_in_another_pid_namespace_are_not_watched():
    me = (os.getpid(), shm_sync.pid_namespace())
    assert shm_sync.peers_visible([me, me])
    assert not shm_sync.peers_visible([me, (os.getpid(), me[1] + 1)])  # a pid there names another process here


def test_a_peer_whose_process_exited_is_named_at_once():
    gone = subprocess.Popen(["true"])
    gone.wait()  # exited and reaped: its pid names no process
    sync, _words, _mm = _sync([os.getpid(), gone.pid])
    wait = sync.start(1, 0)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"rank 1 \(pid {gone.pid}\) exited while rank 0 waited for it"):
        wait()
    assert time.monotonic() - start < 2


def test_a_peer_that_never_arrives_ends_at_the_timeout():
    sync, _words, _mm = _sync([os.getpid(), os.getpid()], timeout_s=0.3)
    wait = sync.start(1, 0)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"waited 0 s \(the transport.s timeout\) for rank 1 .* never reached"):
        wait()
    assert 0.25 < time.monotonic() - start < 3


def test_process_alive_reads_zombies_as_dead():
    child = subprocess.Popen(["true"])
    deadline = time.monotonic() + 5
    while shm_sync.process_alive(child.pid) and time.monotonic() < deadline:
        time.sleep(0.01)  # exited but not reaped yet: a zombie
    assert not shm_sync.process_alive(child.pid)
    child.wait()
    assert shm_sync.process_alive(os.getpid())
