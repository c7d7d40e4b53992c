"""A real one-node Slurm cluster on this machine, for the e2e tests of the Slurm launcher and sbatch script.

:func:`start_cluster` writes a minimal ``slurm.conf`` (this host, its CPUs, one partition) and a
munge key into a temporary directory, then starts ``munged``, ``slurmctld`` and ``slurmd`` with
their state, spool, pid and log files there (``-f <conf>``, ``SLURM_CONF``, munge's own socket):
no system file is read or written. Clients (``sbatch``, ``squeue``, submitit) find the cluster
through the environment :attr:`SlurmCluster.env` returns. :meth:`SlurmCluster.stop` stops the
daemons this helper started, by their pids.

Slurm is started only where it can be: the daemons installed (Debian ``slurm-wlm`` and ``munge``)
and this process root (slurmd runs jobs as their users); otherwise :func:`unavailable` says why,
and the tests skip with that reason. Written here rather than taken from a library: no maintained
Python package starts a throwaway Slurm; the daemons themselves are the real ones.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "srun", "scontrol", "scancel")


def _find(name: str) -> Optional[str]:
    return shutil.which(name) or next(
        (str(p) for p in (Path("/usr/sbin") / name, Path("/sbin") / name) if p.is_file()), None
    )


def unavailable() -> Optional[str]:
    """Why a Slurm cluster cannot start here (None: it can)."""
    missing = [n for n in (*DAEMONS, *CLIENTS) if _find(n) is None]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} not found): apt-get install -y slurm-wlm munge"
    if os.geteuid() != 0:
        return "starting slurmd needs root (it runs jobs as their users)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass
class SlurmCluster:
    """A running one-node cluster: its directory, config file and daemons."""

    root: Path
    conf: Path
    node: str
    cpus: int
    procs: dict[str, subprocess.Popen[bytes]] = dataclasses.field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        """This process's environment plus ``SLURM_CONF`` (clients read the cluster's config) and
        the cluster's ``bin/`` first on PATH (its ``sacct``, :data:`SACCT`)."""
        return {
            **os.environ,
            "SLURM_CONF": str(self.conf),
            "PATH": f"{self.root / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        }

    def logs(self) -> str:
        """The daemons' logs' last lines (for a failing test's message)."""
        out = []
        for name in ("slurmctld", "slurmd", "munged"):
            p = self.root / f"{name}.log"
            if p.is_file():
                out.append(f"--- {name}.log\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:]))
        return "\n".join(out)

    def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Wait until the node accepts jobs (``sinfo``-free: ``scontrol show node``)."""
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            r = subprocess.run(
                [_find("scontrol") or "scontrol", "show", "node", self.node],
                env=self.env,
                capture_output=True,
                text=True,
                timeout=10,
            )
            state = r.stdout + r.stderr
            if "State=IDLE" in state:
                return
            time.sleep(0.5)
        raise RuntimeError(f"the Slurm node did not become idle in {timeout_s:g} s:\n{state}\n{self.logs()}")

    def stop(self) -> None:
        """Cancel the cluster's jobs, stop the daemons (SIGTERM, then SIGKILL after 10 s; last
        started first), then kill what is left of its jobs: slurmstepd and job processes outlive
        a stopped slurmd. They are found by their environment naming this cluster's config."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            subprocess.run(
                [_find("scancel") or "scancel", "--quiet", "--partition=debug"],
                env=self.env,
                capture_output=True,
                timeout=30,
            )
            self._wait_no_jobs(15.0)
        for name, proc in reversed(list(self.procs.items())):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
            del self.procs[name]
        for pid in self.leftover_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _wait_no_jobs(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            r = subprocess.run(
                [_find("squeue") or "squeue", "-h", "-o", "%A"],
                env=self.env,
                capture_output=True,
                text=True,
                timeout=10,
            )
            if r.returncode != 0 or not r.stdout.strip():
                return
            time.sleep(0.5)

    def leftover_pids(self) -> list[int]:
        """Processes (not this one) whose environment has ``SLURM_CONF`` = this cluster's config."""
        mark = f"SLURM_CONF={self.conf}".encode()
        out = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == os.getpid():
                continue
            try:
                environ = (d / "environ").read_bytes()
            except OSError:
                continue
            if mark in environ.split(b"\0"):
                out.append(int(d.name))
        return out


SACCT = """\
#!{python}
# sacct for a cluster without slurmdbd: Slurm's accounting needs slurmdbd and a database, which a
# throwaway test cluster does not run. Answers the one query submitit makes (`sacct -o
# JobID,State,NodeList --parsable2 -j <id> ...`) from slurmctld's own job table (`scontrol show
# job -o`, which keeps finished jobs for MinJobAge seconds), so job states are Slurm's real ones.
import subprocess, sys
args = sys.argv[1:]
ids = [args[i + 1] for i, a in enumerate(args) if a == "-j"]
print("JobID|State|NodeList")
for jid in ids:
    out = subprocess.run(["scontrol", "show", "job", "-o", jid], capture_output=True, text=True).stdout
    for line in out.splitlines():
        f = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
        task = f.get("ArrayTaskId")
        name = f"{{f['ArrayJobId']}}_{{task}}" if task and task.isdigit() else f.get("JobId", jid)
        print(f"{{name}}|{{f.get('JobState', 'UNKNOWN')}}|{{f.get('NodeList', '')}}")
"""
"""The cluster's ``bin/sacct`` (``{python}``: this interpreter)."""


def _slurm_conf(root: Path, node: str, cpus: int, socket_path: Path) -> str:
    return f"""\
ClusterName=zeropptest
SlurmctldHost={node}
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={socket_path}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
NodeName={node} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


def start_cluster(root: Path, cpus: Optional[int] = None) -> SlurmCluster:
    """Start munged, slurmctld and slurmd for a one-node cluster under ``root`` (a fresh directory);
    returns it once the node is idle. Raises RuntimeError with the daemons' logs if one fails."""
    node = socket.gethostname().split(".")[0]
    cpus = cpus or os.cpu_count() or 1
    for d in ("state", "spool", "munge", "bin"):
        (root / d).mkdir(parents=True, exist_ok=True)
    sacct = root / "bin" / "sacct"
    sacct.write_text(SACCT.format(python=sys.executable))
    sacct.chmod(0o755)
    os.chmod(root / "munge", 0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    os.chmod(key, 0o400)
    sock = root / "munge" / "munge.socket"
    conf = root / "slurm.conf"
    conf.write_text(_slurm_conf(root, node, cpus, sock))
    cluster = SlurmCluster(root=root, conf=conf, node=node, cpus=cpus)
    munge_args = [
        f"--key-file={key}",
        f"--socket={sock}",
        f"--pid-file={root / 'munge' / 'munged.pid'}",
        f"--log-file={root / 'munged.log'}",
        f"--seed-file={root / 'munge' / 'munged.seed'}",
    ]
    commands = {
        # --force: the temporary directory's parents (/tmp) are writable by others, which munged refuses otherwise
        "munged": [_find("munged") or "munged", "-F", "--force", *munge_args],
        "slurmctld": [_find("slurmctld") or "slurmctld", "-D", "-i", "-f", str(conf)],
        "slurmd": [_find("slurmd") or "slurmd", "-D", "-f", str(conf)],
    }
    try:
        for name, cmd in commands.items():
            with open(root / f"{name}.out", "wb") as out:
                cluster.procs[name] = subprocess.Popen(
                    cmd, env=cluster.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                )
            if name == "munged":
                _wait_for(sock, 10.0, cluster)
        cluster.wait_idle()
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _wait_for(path: Path, timeout_s: float, cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} did not appear in {timeout_s:g} s:\n{cluster.logs()}")
        time.sleep(0.1)
