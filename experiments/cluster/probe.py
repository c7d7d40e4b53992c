"""Throughput and latency probe between two emulated nodes.

Why: a `tc` command that succeeds does not prove the link behaves as configured (a qdisc on the
wrong end, a burst too small for the kernel timer, a CPU too busy to fill the link). So setup
measures the link it built and the run records the measured number next to the configured one.

How: a tiny TCP server runs inside one node's namespace (`ip netns exec`), a client inside the
other sends for a bounded time *and* a bounded number of bytes; the server times first-to-last
byte. Only the emulated nodes' own addresses are used, never loopback or a host address. Both
sides stop by themselves (socket timeouts), and the parent kills them on its own timeout.

Run as a module for the two roles:
    python -m zeropp.experiments.cluster.probe serve --bind ADDR
    python -m zeropp.experiments.cluster.probe send --to ADDR --port P --seconds 1 --max-bytes N
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

from zeropp.interrupts import end_start_up

_MODULE = "zeropp.experiments.cluster.probe"
# The probe roles run this file directly (not `-m`), so they start fast and never import the
# package's __init__ chain (which may pull in torch/hydra as the experiments package grows).
_SELF = [sys.executable, os.path.abspath(__file__)]
_CHUNK = 1 << 18
_SOCKET_TIMEOUT_S = 10.0


def _prioritize() -> None:
    """Raise this probe process's CPU priority (root only; ignored otherwise).

    The probe checks the *link*; on a host busy with other jobs an ordinary-priority probe gets
    a slice of a core and under-reads the shaped rate. Only this short-lived process is affected.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, 0, -10)
    except (OSError, AttributeError):
        pass


def _serve(bind: str) -> None:
    """Accept one connection; mode byte 'T' = count bytes until EOF, 'R' = echo 1-byte pings."""
    _prioritize()
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((bind, 0))
    srv.listen(1)
    srv.settimeout(_SOCKET_TIMEOUT_S)
    print(json.dumps({"port": srv.getsockname()[1]}), flush=True)
    conn, _ = srv.accept()
    conn.settimeout(_SOCKET_TIMEOUT_S)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    mode = conn.recv(1)
    if mode == b"R":
        while b := conn.recv(1):
            conn.sendall(b)
        print(json.dumps({"mode": "rtt"}), flush=True)
        return
    buf = bytearray(_CHUNK)
    total, t_first, t_last = 0, None, None
    while k := conn.recv_into(buf):
        t_last = time.perf_counter()
        if t_first is None:
            t_first = t_last
        else:
            total += k  # bytes of the first read arrive "at" t_first: count only what follows
    seconds = (t_last - t_first) if t_first is not None and t_last is not None else 0.0
    print(json.dumps({"mode": "throughput", "bytes": total, "seconds": seconds}), flush=True)


def _send(to: str, port: int, seconds: float, max_bytes: int, pings: int) -> None:
    _prioritize()
    conn = socket.create_connection((to, port), timeout=_SOCKET_TIMEOUT_S)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if pings:
        conn.sendall(b"R")
        rtts = []
        for _ in range(pings):
            t0 = time.perf_counter()
            conn.sendall(b"x")
            if conn.recv(1) != b"x":
                raise RuntimeError("probe echo lost")
            rtts.append((time.perf_counter() - t0) * 1e3)
        conn.close()
        print(json.dumps({"rtt_ms": rtts}), flush=True)
        return
    conn.sendall(b"T")
    payload = b"\0" * _CHUNK
    sent, end = 0, time.perf_counter() + seconds
    while sent < max_bytes and time.perf_counter() < end:
        conn.sendall(payload)
        sent += len(payload)
    conn.shutdown(socket.SHUT_WR)
    conn.recv(1)  # wait for the server's close so its clock stops before ours
    conn.close()
    print(json.dumps({"sent": sent}), flush=True)


def _pair(
    server_prefix: list[str], client_prefix: list[str], bind: str, client_args: list[str], timeout: float
) -> tuple[dict, dict]:
    """Start the server under `server_prefix`, read its port, run the client, return both reports."""
    server = subprocess.Popen(
        [*server_prefix, *_SELF, "serve", "--bind", bind], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        line = _readline(server, timeout=min(timeout, 15.0))
        port = json.loads(line)["port"]
        client = subprocess.run(
            [*client_prefix, *_SELF, "send", "--to", bind, "--port", str(port), *client_args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if client.returncode != 0:
            raise RuntimeError(f"probe client failed: {client.stderr.strip()[-2000:]}")
        out, err = server.communicate(timeout=timeout)
        if server.returncode != 0:
            raise RuntimeError(f"probe server failed: {err.strip()[-2000:]}")
        return json.loads(out.strip().splitlines()[-1]), json.loads(client.stdout.strip().splitlines()[-1])
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=5)


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    """First stdout line of `proc`, failing (not hanging) if it exits or stays silent."""
    import selectors

    stdout, stderr = proc.stdout, proc.stderr
    assert stdout is not None and stderr is not None, "the server is started with stdout and stderr piped"
    sel = selectors.DefaultSelector()
    sel.register(stdout, selectors.EVENT_READ)
    if not sel.select(timeout):
        raise RuntimeError(f"probe server printed nothing within {timeout:.0f}s")
    line = stdout.readline()
    if not line:
        raise RuntimeError(f"probe server exited early: {stderr.read().strip()[-2000:]}")
    return line


def measure_throughput(
    server_prefix: list[str],
    client_prefix: list[str],
    server_addr: str,
    *,
    seconds: float = 1.0,
    max_bytes: int = 2 << 30,
) -> float:
    """Gbit/s of TCP payload from the client's namespace to `server_addr` in the server's.

    Payload goodput is ~95% of the tbf rate at MTU 1500 (tbf counts Ethernet/IP/TCP headers).
    """
    srv, _ = _pair(
        server_prefix,
        client_prefix,
        server_addr,
        ["--seconds", str(seconds), "--max-bytes", str(max_bytes)],
        timeout=seconds + 20,
    )
    if srv["seconds"] <= 0:
        raise RuntimeError("probe moved no data")
    return srv["bytes"] * 8 / srv["seconds"] / 1e9


def measure_rtt(server_prefix: list[str], client_prefix: list[str], server_addr: str, *, pings: int = 20) -> float:
    """Median TCP round-trip time in ms (1-byte ping-pong, Nagle off) between the two namespaces."""
    _, cli = _pair(server_prefix, client_prefix, server_addr, ["--pings", str(pings)], timeout=20)
    return float(statistics.median(cli["rtt_ms"]))


def main(argv: list[str] | None = None) -> None:
    end_start_up()  # the start-up SIGTERM stand-in off: a SIGTERM in a C wait ends the process at once
    p = argparse.ArgumentParser(prog=_MODULE, description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="role", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--bind", required=True)
    c = sub.add_parser("send")
    c.add_argument("--to", required=True)
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--seconds", type=float, default=1.0)
    c.add_argument("--max-bytes", type=int, default=2 << 30)
    c.add_argument("--pings", type=int, default=0)
    a = p.parse_args(argv)
    if a.role == "serve":
        _serve(a.bind)
    else:
        _send(a.to, a.port, a.seconds, a.max_bytes, a.pings)


if __name__ == "__main__":
    main()
