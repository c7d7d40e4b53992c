"""The machine's side of the report: versions (Python, torch, Triton, CUDA, NCCL, driver, zeropp),
the CPU, and the GPUs with their topology. Each function is one check (see ``result.py``).

Everything comes from torch's own APIs (``torch.version``, ``torch.cuda``); the driver version and
the NVLink / PCIe matrix come from ``nvidia-smi`` when it is on PATH (torch does not expose them),
run with a time limit.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from importlib import metadata
from typing import Any, Optional

import torch

from .result import NO_CUDA, CheckResult, DoctorOptions, failed, passed, skipped

NVIDIA_SMI_TIMEOUT_S = 20.0
"""The longest one ``nvidia-smi`` call may take (a wedged driver can hang it)."""


def cuda_usable() -> bool:
    """Whether torch sees a CUDA device (what decides between a GPU row and a skipped one)."""
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def nccl_version() -> Optional[str]:
    """NCCL's version as ``major.minor.patch`` (None where torch was built without it)."""
    try:
        v = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return None
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def triton_version() -> Optional[str]:
    """Triton's version, or None where it is not importable."""
    try:
        import triton
    except Exception:
        return None
    return str(triton.__version__)


def zeropp_version() -> str:
    try:
        return metadata.version("zeropp")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def nvidia_smi(*args: str) -> Optional[str]:
    """``nvidia-smi ARGS``'s output, or None where it is absent, fails or hangs."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        res = subprocess.run([exe, *args], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def driver_version() -> Optional[str]:
    out = nvidia_smi("--query-gpu=driver_version", "--format=csv,noheader")
    return out.splitlines()[0].strip() if out else None


def check_versions(options: DoctorOptions) -> CheckResult:
    """Python, torch, Triton and zeropp versions (always a pass: this row only informs)."""
    data: dict[str, Any] = {
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "torch": torch.__version__,
        "triton": triton_version(),
        "zeropp": zeropp_version(),
        "platform": platform.platform(),
    }
    detail = (
        f"Python {data['python']}, torch {data['torch']}, Triton {data['triton'] or 'not installed'}, "
        f"zeropp {data['zeropp']}"
    )
    return passed("versions", detail, **data)


def check_cuda(options: DoctorOptions) -> CheckResult:
    """CUDA runtime, NCCL and driver versions; fails where torch has CUDA built in but sees no
    device although ``nvidia-smi`` does (a driver / runtime mismatch or CUDA_VISIBLE_DEVICES)."""
    data = {"cuda_runtime": torch.version.cuda, "nccl": nccl_version(), "driver": driver_version()}
    if not cuda_usable():
        if torch.version.cuda and data["driver"]:
            return failed(
                "cuda",
                f"torch {torch.__version__} is built for CUDA {torch.version.cuda} and nvidia-smi sees driver "
                f"{data['driver']}, but torch.cuda.is_available() is False: check CUDA_VISIBLE_DEVICES and that "
                "the driver supports this CUDA version",
                **data,
            )
        return skipped("cuda", NO_CUDA, **data)
    detail = f"CUDA runtime {data['cuda_runtime']}, NCCL {data['nccl'] or 'not built in'}, driver {data['driver'] or 'unknown (no nvidia-smi)'}"
    return passed("cuda", detail, **data)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def check_cpu(options: DoctorOptions) -> CheckResult:
    """CPU model, cores present and cores this process may use (affinity: a Slurm or cgroup
    limit shows here), and torch's intra-op threads."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    data = {
        "model": _cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "torch_threads": torch.get_num_threads(),
    }
    detail = f"{data['model']}: {usable} of {data['cores']} cores usable, torch uses {data['torch_threads']} threads"
    return passed("cpu", detail, **data)


def _peer_matrix(n: int) -> list[list[bool]]:
    return [[i == j or bool(torch.cuda.can_device_access_peer(i, j)) for j in range(n)] for i in range(n)]


def check_gpus(options: DoctorOptions) -> CheckResult:
    """Each GPU's name, memory and compute capability; peer access between every pair (what
    torch tells) and ``nvidia-smi topo -m`` (NVLink / PCIe links) where available."""
    if not cuda_usable():
        return skipped("gpus", NO_CUDA)
    n = torch.cuda.device_count()
    devices: list[dict[str, Any]] = []
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        devices.append(
            {
                "index": i,
                "name": p.name,
                "memory_gib": round(p.total_memory / 2**30, 1),
                "capability": f"{p.major}.{p.minor}",
                "multiprocessors": p.multi_processor_count,
            }
        )
    peers = _peer_matrix(n)
    no_peer = [(i, j) for i in range(n) for j in range(n) if not peers[i][j]]
    topo = nvidia_smi("topo", "-m")
    nvlinks = nvlink_pairs(topo, n)
    names = sorted({d["name"] for d in devices})
    detail = (
        f"{n} x {', '.join(names)} ({devices[0]['memory_gib']} GiB, sm_{devices[0]['capability'].replace('.', '')}); "
        + ("peer access between all pairs" if not no_peer else f"no peer access for {len(no_peer)} ordered pairs")
        + ("" if nvlinks is None else f", NVLink between {nvlinks} of {n * (n - 1) // 2} pairs" if n > 1 else "")
        + ("" if n > 1 else " (one GPU)")
    )
    return passed(
        "gpus", detail, count=n, devices=devices, peer_access=peers, nvlink_pairs=nvlinks, nvidia_smi_topo=topo
    )


def nvlink_pairs(topo: Optional[str], n: int) -> Optional[int]:
    """GPU pairs joined by NVLink (``NV<k>`` in ``nvidia-smi topo -m``'s GPU-by-GPU matrix), or
    None without the matrix."""
    if not topo:
        return None
    rows = [line.split() for line in topo.splitlines() if re.match(r"GPU\d+\s", line)]
    links = 0
    for i, row in enumerate(rows[:n]):
        links += sum(1 for j, cell in enumerate(row[1 : n + 1]) if j > i and re.fullmatch(r"NV\d+", cell))
    return links
