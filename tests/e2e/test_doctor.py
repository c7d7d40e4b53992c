"""``python -m zeropp.doctor`` for real on this machine, and its worlds' faults provoked: the
command passes and reports every GPU check as skipped with the reason (CUDA hidden, so also on a
GPU machine); a rank whose network interface does not exist fails the gloo row with torch's
error and what to check; ranks that hang in init or in a collective, or die, are killed at the
world's time limit (or shortly after the first death) and reported with the phase."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.doctor_helpers import rank_program
from zeropp.doctor import CHECKS, world
from zeropp.doctor.result import NO_CUDA, DoctorOptions, Status

GPU_ROWS = ("cuda", "gpus", "Triton kernels", "kernel GB/s", "nccl world")


def test_the_command_passes_here_and_skips_every_gpu_check(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env.pop("TRITON_INTERPRET", None)
    path = tmp_path / "doctor.json"
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "zeropp.doctor", "--json", str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    seconds = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(path.read_text())
    rows = {c["name"]: c for c in report["checks"]}
    assert list(rows) == [name for name, _ in CHECKS]
    for name in GPU_ROWS:
        assert (rows[name]["status"], rows[name]["detail"]) == ("skipped", NO_CUDA), name
    assert {n for n, c in rows.items() if c["status"] == "pass"} >= {"versions", "cpu", "gloo world"}
    assert rows["native CPU kernels"]["status"] in ("pass", "skipped")  # skipped only under ZEROPP_CPU_NATIVE=0
    gloo = rows["gloo world"]["data"]
    assert gloo["world_size"] == 2 and all(r["returncode"] == 0 for r in gloo["ranks"])
    assert report["exit_status"] == 0 and report["seconds"] < seconds
    assert "zeropp doctor: ok:" in proc.stdout and f"skipped: {', '.join(GPU_ROWS)}" in proc.stdout
    assert "gloo world" in proc.stdout and "skipped: no CUDA device" in proc.stdout


def test_a_missing_network_interface_fails_the_gloo_row_with_what_to_check(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuch0")  # the ranks inherit it
    r = world.check_gloo(DoctorOptions(gloo_ranks=1))
    assert r.status is Status.FAIL, r.detail
    assert r.detail.startswith("rank 0 failed in init (gloo, 1 rank(s) on 127.0.0.1:")
    assert "nosuch0" in r.detail and "GLOO_SOCKET_IFNAME" in r.detail


def _launch(body: str, timeout: float, nranks: int = 2) -> tuple[dict, float]:
    opts = DoctorOptions(world_timeout_s=timeout)
    t0 = time.monotonic()
    w = world.launch("gloo", nranks, opts, cmd=rank_program(body))
    return w, time.monotonic() - t0


def test_a_hung_init_is_killed_at_the_time_limit_and_named():
    w, seconds = _launch("emit('started')\ntime.sleep(600)", timeout=3)
    assert w["timed_out"] and 3 <= seconds < 15
    assert all(r["killed"] and r["returncode"] != 0 for r in w["ranks"])
    r = world.verdict("gloo world", "gloo", 2, DoctorOptions(world_timeout_s=3), w)
    assert r.detail.startswith("process-group init hung: not done in 3 s") and "firewall" in r.detail


def test_a_hung_collective_is_named():
    w, _ = _launch("emit('started')\nemit('init', seconds=0.1)\ntime.sleep(600)", timeout=3)
    r = world.verdict("gloo world", "gloo", 2, DoctorOptions(world_timeout_s=3), w)
    assert r.detail.startswith("a collective hung: not done in 3 s")


def test_a_dead_rank_stops_the_world_without_waiting_for_the_limit(monkeypatch):
    monkeypatch.setattr(world, "FAILED_RANK_GRACE_S", 1.0)
    body = "emit('started')\nif rank == 1:\n    sys.exit('rank 1: lost its GPU')\ntime.sleep(600)"
    w, seconds = _launch(body, timeout=120)
    assert not w["timed_out"] and seconds < 60  # the grace after the first death, not the 120 s limit
    assert [r["killed"] for r in w["ranks"]] == [True, False]
    r = world.verdict("gloo world", "gloo", 2, DoctorOptions(world_timeout_s=120), w)
    assert r.detail.startswith("rank 1 exited with 1 during init") and "lost its GPU" in r.detail


DOCTOR_WITH_A_SLOW_WORLD = """
import sys
from zeropp.doctor import __main__ as doctor, world

def slow_world(options):
    return world.launch("gloo", 2, options, cmd=[sys.executable, "-c", {rank!r}])

doctor.CHECKS = [("gloo world", slow_world)]
sys.exit(doctor.main([]))
"""


def test_a_sigterm_while_the_doctor_waits_on_its_ranks_is_one_line_and_stops_them(tmp_path):
    """The world check runs in its own thread; SIGTERM to the doctor (``timeout``, ``kill``) printed
    nothing and left its ranks running until their check ended (the default disposition killed the
    doctor alone). Now: one line, exit 143, and no rank survives."""
    rank = (
        f"import os, pathlib, time\npathlib.Path({str(tmp_path)!r}, f'rank-{{os.getpid()}}').touch()\ntime.sleep(600)\n"
    )
    doctor = subprocess.Popen(
        [sys.executable, "-c", DOCTOR_WITH_A_SLOW_WORLD.format(rank=rank)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pids: list[int] = []
    try:
        for _ in range(600):  # both ranks started (each wrote its pid)
            pids = [int(p.name.split("-")[1]) for p in tmp_path.glob("rank-*")]
            if len(pids) == 2:
                break
            time.sleep(0.05)
        assert len(pids) == 2, doctor.stderr.read() if doctor.poll() is not None and doctor.stderr else pids
        doctor.send_signal(signal.SIGTERM)
        _, err = doctor.communicate(timeout=60)
    finally:
        doctor.kill()
        survivors = [pid for pid in pids if _alive(pid)]
        for pid in survivors:
            os.kill(pid, signal.SIGKILL)
    assert (doctor.returncode, err) == (
        128 + signal.SIGTERM,
        "zeropp doctor: error: interrupted by SIGTERM; no report written\n",
    )
    assert survivors == []


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by init, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
