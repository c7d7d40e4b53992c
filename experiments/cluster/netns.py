"""Network-namespace plumbing for the cluster emulator: thin wrappers over `ip` and `tc`.

Why subprocess calls and not netlink bindings: `ip`/`tc` (iproute2) are on every Linux box that
can do this at all, their error messages are what users will search for, and a failed command
can be shown verbatim. Every call has a timeout, so a wedged kernel call fails instead of hanging.

Safety rules this module enforces, because it runs as root:
- it only ever creates, enters or deletes namespaces whose names start with ``<prefix>-``;
- interfaces are created *directly inside* those namespaces (``ip -n NS link add ... peer ...
  netns OTHER``), so the host's root namespace never gains or loses an interface or route;
- processes are only signalled when they live inside one of those namespaces (i.e. were started
  there by this project), and only by pid.

Namespace names carry the owning process's id and start time (``zpp-<pid>-<start>-<k>-n0``,
:func:`owner_tag`) so a later run can tell a namespace left behind by a crashed run (owner gone,
or its pid now reused by another program, which started at another time) from one a live run is
using.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass

CMD_TIMEOUT_S = 15.0
_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,7}$")
LOCAL_HINT = "To run without emulation use the plain local topology: cluster=local."


class NetnsError(RuntimeError):
    """An `ip`/`tc` command failed; the message holds the command and its stderr."""


class ClusterPrivilegeError(NetnsError):
    """This process cannot create network namespaces (not root, no iproute2, or forbidden)."""


def check_prefix(prefix: str) -> str:
    """Prefixes end up in interface names (15 chars max), so keep them short and plain."""
    if not _PREFIX_RE.match(prefix):
        raise ValueError(f"cluster prefix {prefix!r} must be 1-8 lowercase letters/digits starting with a letter")
    return prefix


def run(cmd: list[str], *, timeout: float = CMD_TIMEOUT_S, check: bool = True) -> subprocess.CompletedProcess:
    """Run one command with a timeout; on failure raise NetnsError quoting the command and stderr."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as e:
        raise ClusterPrivilegeError(
            f"`{cmd[0]}` not found: the cluster emulator needs iproute2 (`ip`, `tc`); install it "
            f"(e.g. `apt-get install -y iproute2`). {LOCAL_HINT}"
        ) from e
    except subprocess.TimeoutExpired as e:
        raise NetnsError(f"`{' '.join(cmd)}` did not finish within {timeout:.0f}s") from e
    if check and proc.returncode != 0:
        raise NetnsError(
            f"`{' '.join(cmd)}` failed (exit {proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}"
        )
    return proc


def ip_ns(ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`ip -n NS ...`: an `ip` command executed inside namespace NS."""
    return run(["ip", "-n", ns, *args], check=check)


def tc_ns(ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`tc` inside NS (via `ip netns exec`, which works on every iproute2 version)."""
    return run(["ip", "netns", "exec", ns, "tc", *args], check=check)


# ----------------------------------------------------------------------------- privileges


def require_privileges(prefix: str = "zpp") -> None:
    """Fail early, with what to change, when namespaces cannot be created here.

    Checks in order: Linux, root (CAP_NET_ADMIN is what is really needed, and root is the only
    portable way to have it), `ip` and `tc` on PATH, and finally that `ip netns add` really works
    (containers often forbid it even to root).
    """
    check_prefix(prefix)
    if not os.path.isdir("/proc/self/ns"):
        raise ClusterPrivilegeError(f"network namespaces need Linux. {LOCAL_HINT}")
    if os.geteuid() != 0:
        raise ClusterPrivilegeError(
            "cluster=emulated creates network namespaces, veth pairs and tc qdiscs, which needs root "
            f"(CAP_NET_ADMIN); this process runs as uid {os.geteuid()}. Re-run as root (e.g. with sudo). {LOCAL_HINT}"
        )
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        elsewhere = [d for d in ("/usr/sbin", "/sbin", "/usr/bin", "/bin") if os.access(f"{d}/{missing[0]}", os.X_OK)]
        fix = (  # installed but off PATH (sudo's or cron's PATH, a venv's wrapper): say so, not "install it"
            f"found in {elsewhere[0]}, which is not on PATH ({os.environ.get('PATH', '')}): add {elsewhere[0]} to PATH"
            if elsewhere
            else "install iproute2 (`apt-get install -y iproute2`)"
        )
        raise ClusterPrivilegeError(f"{' and '.join(missing)} not found on PATH: {fix}. {LOCAL_HINT}")
    trial = f"{prefix}-{owner_tag()}-probe"
    refuse_existing(trial)
    try:
        run(["ip", "netns", "add", trial])
    except NetnsError as e:
        raise ClusterPrivilegeError(
            f"cannot create a network namespace here ({e}); containers need --privileged or CAP_SYS_ADMIN "
            f"+ CAP_NET_ADMIN. {LOCAL_HINT}"
        ) from e
    run(["ip", "netns", "del", trial], check=False)  # only once made here: a namespace of that name before is not ours


def qdisc_supported(kind: str, prefix: str = "zpp") -> bool:
    """Whether the kernel offers qdisc `kind` (e.g. netem is often compiled out of minimal kernels).

    Tested on a veth inside a throw-away namespace of ours, never on a real interface.
    """
    ns = f"{prefix}-{owner_tag()}-qcheck"
    refuse_existing(ns)
    run(["ip", "netns", "add", ns])
    try:
        # a veth pair (always available where the emulator works at all; `dummy` often is not)
        ip_ns(ns, "link", "add", f"{prefix}-q", "type", "veth", "peer", "name", f"{prefix}-qp")
        args = {"netem": ["delay", "1ms"], "tbf": ["rate", "1gbit", "burst", "64kb", "limit", "1mb"]}.get(kind, [])
        return tc_ns(ns, "qdisc", "add", "dev", f"{prefix}-q", "root", kind, *args, check=False).returncode == 0
    finally:
        run(["ip", "netns", "del", ns], check=False)


# ----------------------------------------------------------------------------- namespaces


def start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (field 22 of ``/proc/<pid>/stat``),
    or None when there is no such process. A pid is reused by later processes; the pair (pid,
    start time) names one process for as long as the machine runs (and network namespaces do not
    outlive a reboot)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])  # fields after the command's name start at 3
    except (OSError, IndexError, ValueError):
        return None


def owner_tag(pid: int | None = None) -> str:
    """``<pid>-<start ticks>`` of this process (or ``pid``): the owner part of the names it creates;
    ``<pid>-0`` when the start time cannot be read (:func:`owner_alive` then judges by the pid)."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}-{start_ticks(pid) or 0}"


def _name_re(prefix: str) -> re.Pattern:
    """The exact names this package creates: ``<p>-<pid>-<start>-<k>-sw|n<i>`` and its short-lived
    checks, and the ``<p>-<pid>-<k>-...`` of versions that named the pid only (group 2 is None)."""
    kinds = r"(\d+-(sw|n\d+)|probe|qcheck)"
    return re.compile(rf"^{re.escape(prefix)}-(\d+)-(?:(\d+)-{kinds}|{kinds})$")


def list_namespaces(prefix: str) -> list[str]:
    """Existing namespaces named the way this package names them (others, even ``<prefix>-foo``, are ignored)."""
    out = run(["ip", "netns", "list"]).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    pattern = _name_re(prefix)
    return sorted(n for n in names if pattern.match(n))


def owner_pid(name: str, prefix: str) -> int | None:
    """The pid encoded in ``<prefix>-<pid>-...``, or None for names in another format."""
    m = _name_re(prefix).match(name)
    return int(m.group(1)) if m else None


def owner_alive(name: str, prefix: str) -> bool:
    """Whether the process that created namespace ``name`` still runs: its pid is alive and started
    when the name says (a pid reused by another program started later). Names of versions that
    recorded the pid only, and names whose owner could not read its start time (``<pid>-0``: see
    :func:`owner_tag`), are judged by the pid alone: a live owner's namespaces are never removed."""
    m = _name_re(prefix).match(name)
    if m is None:
        return False
    pid = int(m.group(1))
    if m.group(2) is None or int(m.group(2)) == 0:
        return pid_alive(pid)
    return pid_alive(pid) and start_ticks(pid) == int(m.group(2))


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def namespace_pids(ns: str) -> list[int]:
    """Processes whose network namespace is NS (`ip netns pids`)."""
    proc = run(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit() and int(p) != os.getpid()]


def kill_namespace_processes(ns: str, grace_s: float = 2.0) -> list[int]:
    """SIGTERM then SIGKILL every process inside NS (rank processes we started there).

    Deleting a namespace's name does not stop processes inside it; they would keep the veth and
    its addresses alive and keep gloo ranks waiting, so they go first.
    """
    pids = namespace_pids(ns)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline and any(pid_alive(p) and not _is_zombie(p) for p in pids):
            time.sleep(0.05)
        pids = [p for p in pids if pid_alive(p) and not _is_zombie(p)]
        if not pids:
            break
    return pids


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def refuse_existing(ns: str) -> None:
    """Raise :class:`NetnsError` when a namespace named ``ns`` exists already.

    Names carry this process's pid and start time, so one that exists before this process made it
    belongs to someone else (a user's). It is neither entered,
    emptied nor deleted; the user is told how to remove it if it is a leftover.
    """
    if ns in run(["ip", "netns", "list"]).stdout.split():
        raise NetnsError(
            f"a network namespace named {ns} exists already and was not made by this process (a leftover "
            f"of an earlier process with the same pid, or someone else's); it was left untouched. If nothing "
            f"uses it (`ip netns pids {ns}` prints nothing), remove it with `ip netns del {ns}` and run again"
        )


def add_namespace(ns: str) -> None:
    """Create ``ns`` (refused if it exists: :func:`refuse_existing`) with its loopback up; on a
    failure after the creation, the new namespace is deleted again, so the caller owns a namespace
    exactly when this returns."""
    refuse_existing(ns)
    run(["ip", "netns", "add", ns])
    try:
        ip_ns(ns, "link", "set", "lo", "up")
    except BaseException:
        run(["ip", "netns", "del", ns], check=False)
        raise


def delete_namespace(ns: str) -> None:
    """Kill what runs inside NS, then delete it (its veth ends go with it). Idempotent."""
    kill_namespace_processes(ns)
    run(["ip", "netns", "del", ns], check=False)


def stale_namespaces(prefix: str) -> list[str]:
    """Namespaces of ours whose owning process is gone (:func:`owner_alive`): left behind by a
    crashed run, even when its pid now belongs to another program."""
    return [n for n in list_namespaces(prefix) if not owner_alive(n, prefix)]


def clean(prefix: str, *, everything: bool = False) -> list[str]:
    """Delete stale namespaces (or, with everything=True, all of ours, live too); return their names.

    Switch namespaces (holding the bridge) go last so node ends are gone first.
    """
    check_prefix(prefix)
    names = list_namespaces(prefix) if everything else stale_namespaces(prefix)
    for ns in sorted(names, key=lambda n: n.endswith("-sw")):
        delete_namespace(ns)
    return names


def interface_tx_bytes(ifname: str) -> int | None:
    """Bytes interface ``ifname`` of this process's network namespace has sent so far (the kernel's
    counter, headers included), or None when there is no such interface. A rank of the emulated
    cluster runs under ``ip netns exec``, which mounts its node namespace's ``/sys``, so its
    uplink's counter is that node's."""
    if not ifname or "/" in ifname or ifname in (".", ".."):
        return None
    try:
        with open(f"/sys/class/net/{ifname}/statistics/tx_bytes") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


# ----------------------------------------------------------------------------- links and shaping


def add_bridge(ns: str, bridge: str) -> None:
    ip_ns(ns, "link", "add", bridge, "type", "bridge")
    ip_ns(ns, "link", "set", bridge, "up")


def add_uplink(node_ns: str, node_if: str, switch_ns: str, port_if: str, bridge: str, cidr: str) -> None:
    """A veth pair born directly inside the node and switch namespaces, the switch end on the bridge."""
    ip_ns(node_ns, "link", "add", node_if, "type", "veth", "peer", "name", port_if, "netns", switch_ns)
    ip_ns(switch_ns, "link", "set", port_if, "master", bridge)
    ip_ns(switch_ns, "link", "set", port_if, "up")
    ip_ns(node_ns, "addr", "add", cidr, "dev", node_if)
    ip_ns(node_ns, "link", "set", node_if, "up")


SLOW_START_AFTER_IDLE = "/proc/sys/net/ipv4/tcp_slow_start_after_idle"


def keep_tcp_window_when_idle(ns: str) -> None:
    """Turn off TCP's slow-start restart after idle (``net.ipv4.tcp_slow_start_after_idle=0``,
    a per-namespace sysctl) inside ``ns``.

    Why: a collective's connection sits idle while the ranks compute, and Linux by default
    shrinks its congestion window back to the initial one after an idle period of one RTO; the
    tbf queue inflates the RTT, so each gather restarted from a small window. Datacentre
    fabrics (RDMA, NCCL's transports) have no such restart, and many TCP clusters turn it off.
    On the development machine its effect was within run-to-run noise (ZeRO-3 on 2x2, median of
    3: 1.850 vs 1.844 s per step at 0.2 Gbit/s, 0.385 vs 0.398 s at 1 Gbit/s; docs/benchmarks.md,
    projection check), but a fabric should not depend on it."""
    # /proc/sys/net shows the reading process's namespace; sh, not sysctl (procps may be absent)
    run(["ip", "netns", "exec", ns, "sh", "-c", f"echo 0 > {SLOW_START_AFTER_IDLE}"])


@dataclass(frozen=True)
class Shaping:
    """tbf parameters for one egress point, sized from the rate.

    burst: 5 ms of traffic (at least 64 KiB so a GSO super-packet is not split needlessly). The
    bucket must cover how late tbf's dequeue can run: on a loaded host the NET_TX softirq slips to
    ksoftirqd, and tokens beyond the bucket are lost. Measured on the 2-core dev box at load ~12:
    a 1 ms bucket gave 83% of 0.5 Gbit/s, 5 ms 96%, 10 ms 96%. A burst lets at most 5 ms of data
    through at line rate, which changes a 1 s transfer by <1%. limit: about 50 ms of queue (at
    least 1 MiB), so TCP bursts queue rather than drop, as on a switch port buffer.
    """

    rate_bit: int
    burst_bytes: int
    limit_bytes: int
    delay_ms: float = 0.0

    @classmethod
    def for_rate(cls, gbps: float, delay_ms: float = 0.0) -> Shaping:
        rate_bit = int(gbps * 1e9)
        byte_rate = rate_bit / 8
        return cls(
            rate_bit,
            max(64 * 1024, int(byte_rate * 5e-3)),
            max(1 << 20, int(byte_rate * 0.05), 2 * int(byte_rate * 5e-3)),
            delay_ms,
        )


def shape_egress(ns: str, ifname: str, shaping: Shaping) -> None:
    """Rate-limit (and optionally delay) traffic leaving `ifname` in `ns`.

    With a delay: netem at the root (holds packets for the delay) and tbf as its child (rate).
    """
    tbf = [
        "tbf",
        "rate",
        f"{shaping.rate_bit}bit",
        "burst",
        str(shaping.burst_bytes),
        "limit",
        str(shaping.limit_bytes),
    ]
    if shaping.delay_ms > 0:
        # netem's own queue must hold a delay's worth of packets at full rate (plus headroom).
        pkts = max(1000, int(shaping.rate_bit / 8 * shaping.delay_ms / 1000 / 1500 * 4))
        tc_ns(
            ns,
            "qdisc",
            "replace",
            "dev",
            ifname,
            "root",
            "handle",
            "1:",
            "netem",
            "delay",
            f"{shaping.delay_ms}ms",
            "limit",
            str(pkts),
        )
        tc_ns(ns, "qdisc", "replace", "dev", ifname, "parent", "1:1", "handle", "10:", *tbf)
    else:
        tc_ns(ns, "qdisc", "replace", "dev", ifname, "root", "handle", "1:", *tbf)
