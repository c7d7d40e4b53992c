"""The doctor's GPU half on a CUDA machine: every GPU row passes and says what torch says (versions,
device count and names), the Triton kernels are bit-exact against the reference on this device,
the GB/s rows are measured, the NCCL world of every local GPU passes its plain and quantized
collectives, and the whole command exits 0 with no GPU row skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from zeropp.doctor import kernel_checks, system, world
from zeropp.doctor.result import DoctorOptions, Status

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

OPTS = DoctorOptions()


def test_the_cuda_and_gpu_rows_report_what_torch_reports():
    r = system.check_cuda(OPTS)
    assert r.status is Status.PASS, r.detail
    assert r.data["cuda_runtime"] == torch.version.cuda and r.data["nccl"] == system.nccl_version()
    g = system.check_gpus(OPTS)
    assert g.status is Status.PASS, g.detail
    n = torch.cuda.device_count()
    assert g.data["count"] == n and [d["name"] for d in g.data["devices"]] == [
        torch.cuda.get_device_name(i) for i in range(n)
    ]
    assert len(g.data["peer_access"]) == n and all(g.data["peer_access"][i][i] for i in range(n))


def test_the_triton_kernels_are_bit_exact_on_this_device():
    assert os.environ.get("TRITON_INTERPRET") != "1"
    r = kernel_checks.check_triton(OPTS)
    assert r.status is Status.PASS, r.detail
    assert kernel_checks.mismatches(torch.device("cuda"), "triton") == []


def test_the_bandwidth_row_measures_the_kernels_against_a_copy():
    r = kernel_checks.check_bandwidth(OPTS)
    assert r.status is Status.PASS, r.detail
    gbs = r.data["gb_per_s"]
    assert set(gbs) == {"copy", "quantize_int8", "dequantize_int8"} and all(v > 0 for v in gbs.values())


def test_the_nccl_world_of_every_local_gpu_passes():
    r = world.check_nccl(OPTS)
    assert r.status is Status.PASS, r.detail
    assert r.data["world_size"] == torch.cuda.device_count()


def test_the_command_passes_with_no_gpu_row_skipped(tmp_path):
    path = tmp_path / "doctor.json"
    proc = subprocess.run(
        [sys.executable, "-m", "zeropp.doctor", "--json", str(path)], capture_output=True, text=True, timeout=400
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {c["name"]: c for c in json.loads(path.read_text())["checks"]}
    for name in ("cuda", "gpus", "Triton kernels", "kernel GB/s", "nccl world", "gloo world"):
        assert rows[name]["status"] == "pass", rows[name]
