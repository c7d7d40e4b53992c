"""``zeropp.doctor`` without child processes: each check against its reference (versions from
torch itself, the kernels against ``kernels/reference.py`` with a broken kernel injected, a
missing compiler, a hung ``nvidia-smi``), the GPU rows' skip reason, the time limit of a hung
check, the table / JSON / exit status with failing checks injected, the ``--json`` path refused
before anything runs, the world's verdict on crafted rank reports, and one rank's collective
checks in a one-rank world (with a too-noisy quantized collective injected)."""

from __future__ import annotations

import io
import json
import os
import platform
import stat
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.doctor_helpers import failing_check, hung_check, ok_check, raising_check, skipped_check
from zeropp import doctor
from zeropp.doctor import __main__ as cli
from zeropp.doctor import kernel_checks, rank, report, system, world
from zeropp.doctor.result import NO_CUDA, CheckResult, DoctorOptions, Status, passed, run_check
from zeropp.kernels import cpu_adamw, cpu_native

OPTS = DoctorOptions()


def _fake_nvidia_smi(tmp_path: Path, monkeypatch, body: str) -> None:
    """Put an ``nvidia-smi`` shell script running ``body`` first on PATH."""
    exe = tmp_path / "bin" / "nvidia-smi"
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\n" + body + "\n")
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{exe.parent}{os.pathsep}{os.environ['PATH']}")


# ------------------------------------------------------------------------------- system rows
def test_versions_row_reports_this_interpreters_versions():
    r = system.check_versions(OPTS)
    assert r.status is Status.PASS
    assert r.data["python"] == platform.python_version() and r.data["torch"] == torch.__version__
    try:
        import triton

        assert r.data["triton"] == triton.__version__
    except ImportError:
        assert r.data["triton"] is None and "Triton not installed" in r.detail
    assert f"torch {torch.__version__}" in r.detail


def test_cpu_row_counts_the_cores_this_process_may_use():
    r = system.check_cpu(OPTS)
    assert r.status is Status.PASS
    assert r.data["usable_cores"] == len(os.sched_getaffinity(0)) and r.data["cores"] == os.cpu_count()
    assert r.data["torch_threads"] == torch.get_num_threads()


def test_without_cuda_every_gpu_row_is_skipped_with_the_reason(monkeypatch):
    monkeypatch.setattr(system, "cuda_usable", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    checks = (system.check_cuda, system.check_gpus, kernel_checks.check_triton, kernel_checks.check_bandwidth)
    for fn in (*checks, world.check_nccl):
        r = fn(OPTS)
        assert (r.status, r.detail) == (Status.SKIP, NO_CUDA), fn.__name__
    assert NO_CUDA.startswith("skipped: no CUDA device")


def test_a_cuda_torch_that_sees_no_device_while_the_driver_is_there_fails(tmp_path, monkeypatch):
    _fake_nvidia_smi(tmp_path, monkeypatch, 'echo "550.54.15"')
    monkeypatch.setattr(system, "cuda_usable", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    r = system.check_cuda(OPTS)
    assert r.status is Status.FAIL and r.data["driver"] == "550.54.15"
    assert "CUDA_VISIBLE_DEVICES" in r.detail and "12.4" in r.detail


def test_a_hung_nvidia_smi_is_given_up_on(tmp_path, monkeypatch):
    _fake_nvidia_smi(tmp_path, monkeypatch, "exec sleep 600")
    monkeypatch.setattr(system, "NVIDIA_SMI_TIMEOUT_S", 0.5)
    t0 = time.monotonic()
    assert system.driver_version() is None
    assert time.monotonic() - t0 < 10


def test_nccl_version_is_dotted_or_none():
    v = system.nccl_version()
    assert v is None or all(p.isdigit() for p in v.split("."))


# ------------------------------------------------------------------------------- kernels
def test_same_bits_tells_signed_zeros_and_ulps_apart_but_not_nan_payloads():
    a = torch.tensor([0.0, 1.0, float("nan")])
    assert kernel_checks.same_bits(a, a.clone())
    assert not kernel_checks.same_bits(a, torch.tensor([-0.0, 1.0, float("nan")]))
    assert not kernel_checks.same_bits(
        a, torch.tensor([0.0, torch.nextafter(torch.tensor(1.0), torch.tensor(2.0)).item(), float("nan")])
    )
    assert not kernel_checks.same_bits(a, torch.tensor([0.0, 1.0, 0.0]))
    assert not kernel_checks.same_bits(a, a.double())


def test_native_cpu_kernels_build_and_match_the_reference():
    if not cpu_native.ENABLED:
        pytest.skip("ZEROPP_CPU_NATIVE=0 in this environment")
    r = kernel_checks.check_native_cpu(OPTS)
    assert r.status is Status.PASS, r.detail
    assert Path(r.data["library"]).is_file()


SMALL = [((17, 257), 17, 100)]


def test_a_quantize_kernel_off_by_one_code_is_caught(monkeypatch):
    real = kernel_checks.quantize

    def off_by_one(x, bits, *args, **kw):
        q = real(x, bits, *args, **kw)
        if bits == 4:
            q.codes.view(-1)[3] ^= 1  # one nibble off by one
        return q

    monkeypatch.setattr(kernel_checks, "quantize", off_by_one)
    bad = kernel_checks.mismatches(torch.device("cpu"), "torch", SMALL)
    assert bad and all(b.startswith("quantize 17x257 rows=17 g=100 int4") for b in bad), bad
    r = kernel_checks.bit_exact_row("native CPU kernels", "built and loaded; ", bad)
    assert r.status is Status.FAIL and r.data["mismatches"] == bad
    assert (
        r.detail.startswith(f"built and loaded; NOT bit-exact: {len(bad)} case(s) differ")
        and "first: quantize 17x257" in r.detail
    )


def test_a_dequantize_sum_one_ulp_off_is_caught(monkeypatch):
    real = kernel_checks.dequantize_sum

    def one_ulp(q, **kw):
        out = real(q, **kw)
        return torch.nextafter(out, torch.full_like(out, float("inf")))

    monkeypatch.setattr(kernel_checks, "dequantize_sum", one_ulp)
    bad = kernel_checks.mismatches(torch.device("cpu"), "torch", SMALL)
    assert bad and all(b.startswith("dequantize_sum ") for b in bad), bad
    assert kernel_checks.mismatches(torch.device("cpu"), "torch", SMALL[:0]) == []


def test_a_missing_compiler_fails_the_native_row_with_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_native, "ENABLED", True)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    r = kernel_checks.check_native_cpu(OPTS)
    assert r.status is Status.FAIL
    assert "do not build here" in r.detail and "no-such-g++" in r.detail and "install g++ or set CXX" in r.detail


def test_the_cpu_adamw_row_says_which_optimizer_path_runs(tmp_path, monkeypatch):
    """Built and bit-exact with torch: a pass that says the in-memory optimizer runs it; built but
    not bit-exact here: a pass that says torch's ops run instead; no compiler: a failed row naming
    the fix and the fallback."""
    r = kernel_checks.check_cpu_adamw(OPTS)
    if cpu_adamw.available():
        assert r.status is Status.PASS and r.data["exact"] is cpu_adamw.reproduces_reference(), r.detail
    monkeypatch.setattr(cpu_adamw, "reproduces_reference", lambda: False)
    if cpu_adamw.available():
        r = kernel_checks.check_cpu_adamw(OPTS)
        assert r.status is Status.PASS and r.data["exact"] is False
        assert "the in-memory optimizer of CPU ranks runs torch's own ops" in r.detail
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    monkeypatch.setenv("ZEROPP_CACHE_DIR", str(tmp_path / "cache"))
    r = kernel_checks.check_cpu_adamw(OPTS)
    assert r.status is Status.FAIL, r.detail
    assert "does not build here" in r.detail and "no-such-g++" in r.detail and "fall back to torch's AdamW" in r.detail


def test_native_kernels_turned_off_are_a_skip(monkeypatch):
    monkeypatch.setattr(cpu_native, "ENABLED", False)
    r = kernel_checks.check_native_cpu(OPTS)
    assert r.status is Status.SKIP and "ZEROPP_CPU_NATIVE=0" in r.detail


def test_bandwidth_counts_bytes_read_and_written():
    calls = []

    def timer(fn):  # each op "takes" 1 ms, so GB/s = bytes / 1e6
        fn()
        calls.append(fn)
        return 1e-3

    gbs = kernel_checks.bandwidth(torch.device("cpu"), nbytes=4 << 10, timer=timer)
    n = 1 << 10
    q = (4 << 10) + kernel_checks.quantized_nbytes(1, n, 8, 512)
    assert len(calls) == 3
    assert gbs == {
        "copy": round(2 * (4 << 10) / 1e6, 1),
        "quantize_int8": round(q / 1e6, 1),
        "dequantize_int8": round(q / 1e6, 1),
    }


def test_quick_skips_the_bandwidth_row(monkeypatch):
    monkeypatch.setattr(system, "cuda_usable", lambda: True)
    r = kernel_checks.check_bandwidth(DoctorOptions(quick=True))
    assert (r.status, r.detail) == (Status.SKIP, "skipped: --quick")


# ------------------------------------------------------------------------------- running checks
def test_a_raising_check_is_a_failed_row_naming_the_exception():
    r = run_check("x", raising_check, OPTS)
    assert r.status is Status.FAIL and r.detail.startswith("raised ZeroDivisionError at doctor_helpers.py:")


def test_a_hung_check_fails_at_its_time_limit_and_the_run_goes_on():
    t0 = time.monotonic()
    rows = doctor.run_checks(
        DoctorOptions(check_timeout_s=0.5), [("hung", hung_check), ("ok", ok_check)], progress=None
    )
    assert time.monotonic() - t0 < 10
    assert [r.status for r in rows] == [Status.FAIL, Status.PASS]
    assert rows[0].detail.startswith("did not finish in 0.5 s") and rows[0].seconds >= 0.5
    assert rows[1].data == {"answer": 42}


def test_options_and_results_are_validated():
    for bad in (
        {"check_timeout_s": 0},
        {"world_timeout_s": -1},
        {"world_timeout_s": True},
        {"gloo_ranks": 0},
        {"master_addr": " "},
    ):
        with pytest.raises(ValueError):
            DoctorOptions(**bad)
    with pytest.raises(ValueError, match="one-line detail"):
        CheckResult(name="a", status=Status.PASS, detail="two\nlines")
    with pytest.raises(TypeError):
        CheckResult(name="a", status="pass", detail="")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------- report
ROWS = [passed("ok", "fine"), doctor.run_check("broken", failing_check, OPTS), skipped_check(OPTS)]


def test_exit_status_is_1_only_when_a_check_failed():
    assert report.exit_status(ROWS) == 1
    assert report.exit_status([ROWS[0], ROWS[2]]) == 0
    assert report.summary_line(ROWS) == "zeropp doctor: FAILED: 1 passed, 1 failed, 1 skipped (skipped: gpu thing)"


def test_the_table_has_a_row_per_check():
    buf = io.StringIO()
    report.print_report(ROWS, buf)
    text = buf.getvalue()
    for r in ROWS:
        assert r.name in text and r.status.value in text and r.detail in text
    assert text.rstrip().endswith("(skipped: gpu thing)")


def test_the_json_report_round_trips(tmp_path):
    path = tmp_path / "doctor.json"
    path.write_text("old")
    report.write_json(path, report.to_json(ROWS, 1.5))
    d = json.loads(path.read_text())
    assert d["schema"] == report.SCHEMA and d["exit_status"] == 1 and d["seconds"] == 1.5
    assert d["counts"] == {"pass": 1, "fail": 1, "skipped": 1}
    assert [c["name"] for c in d["checks"]] == ["ok", "broken", "gpu thing"]
    assert d["checks"][1]["status"] == "fail" and d["checks"][1]["detail"] == "it broke; change this"
    assert os.listdir(tmp_path) == ["doctor.json"]  # no temporary file left


def test_a_json_path_that_cannot_be_written_is_refused(tmp_path):
    with pytest.raises(ValueError, match="is a directory"):
        report.check_json_path(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        report.check_json_path(tmp_path / "missing" / "d.json")
    with pytest.raises(ValueError, match="cannot write in /sys"):
        report.check_json_path(Path("/sys/doctor.json"))  # a real unwritable directory, even for root
    report.check_json_path(tmp_path / "d.json")
    assert os.listdir(tmp_path) == []  # the probe is gone


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in a read-only directory")
def test_a_read_only_directory_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        with pytest.raises(ValueError, match="cannot write in"):
            report.check_json_path(ro / "d.json")
    finally:
        ro.chmod(0o700)


# ------------------------------------------------------------------------------- command line
def test_the_command_exits_1_on_a_failed_check_and_writes_the_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "CHECKS", [("ok", ok_check), ("broken", failing_check), ("gpu thing", skipped_check)])
    assert cli.main(["--json", str(tmp_path / "d.json")]) == 1
    d = json.loads((tmp_path / "d.json").read_text())
    assert [c["status"] for c in d["checks"]] == ["pass", "fail", "skipped"]
    out, err = capsys.readouterr()
    assert "FAILED: 1 passed, 1 failed, 1 skipped" in out and "doctor: broken: fail" in err


def test_the_command_exits_0_when_only_skips_remain(monkeypatch, capsys):
    monkeypatch.setattr(cli, "CHECKS", [("ok", ok_check), ("gpu thing", skipped_check)])
    assert cli.main([]) == 0
    assert "zeropp doctor: ok: 1 passed, 0 failed, 1 skipped" in capsys.readouterr().out


def test_a_bad_command_line_exits_2_before_any_check(tmp_path, monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(cli, "CHECKS", [("ok", lambda o: ran.append(1) or ok_check(o))])
    for argv in (["--json", str(tmp_path)], ["--json", "/sys/d.json"], ["--world-timeout", "0"], ["--gloo-ranks", "0"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2, argv
    assert ran == []
    err = capsys.readouterr().err
    assert (
        "is a directory" in err
        and "cannot write in /sys" in err
        and "--world-timeout must be a number of seconds > 0" in err
    )


# ------------------------------------------------------------------------------- a world's verdict
def _rank(r: int, *events: dict, rc: int = 0, killed: bool = False, stderr: str = "") -> dict:
    return {"rank": r, "returncode": rc, "events": list(events), "stderr_tail": stderr, "killed": killed}


GOOD = {"all_gather": {"ok": True, "error": 0.0, "bound": 0.0, "detail": "max error 0 (bound 0)"}}
STARTED, INIT, DONE = {"event": "started"}, {"event": "init", "seconds": 0.5}, {"event": "done", "checks": GOOD}


def _verdict(*ranks: dict, timed_out: bool = False):
    return world.verdict(
        "gloo world", "gloo", len(ranks), OPTS, {"ranks": list(ranks), "timed_out": timed_out, "port": 1234}
    )


def test_verdict_passes_a_world_whose_ranks_all_checked_ok():
    r = _verdict(_rank(0, STARTED, INIT, DONE), _rank(1, STARTED, INIT, DONE))
    assert r.status is Status.PASS and r.detail.startswith("2 rank(s) initialize in 0.5 s")


def test_verdict_names_the_phase_that_hung_and_what_to_check():
    r = _verdict(_rank(0, STARTED, rc=-9, killed=True), _rank(1, STARTED, INIT, rc=-9, killed=True), timed_out=True)
    assert r.status is Status.FAIL and r.detail.startswith(
        "process-group init hung: not done in 60 s (gloo, 2 rank(s) on 127.0.0.1:1234)"
    )
    assert "firewall" in r.detail and "MASTER_ADDR" in r.detail and "NCCL_SOCKET_IFNAME" in r.detail
    r = _verdict(_rank(0, STARTED, INIT, rc=-9, killed=True), timed_out=True)
    assert r.detail.startswith("a collective hung")


def test_verdict_reports_a_ranks_error_and_a_crash():
    err = {"event": "error", "phase": "init", "error": "RuntimeError: Connection refused"}
    r = _verdict(_rank(0, STARTED, err, rc=1), _rank(1, STARTED, rc=-9, killed=True))
    assert r.detail.startswith("rank 0 failed in init (gloo") and "Connection refused" in r.detail
    r = _verdict(
        _rank(0, STARTED, rc=-9, killed=True), _rank(1, STARTED, INIT, rc=-11, stderr="boom\nSegmentation fault")
    )
    assert r.detail.startswith("rank 1 exited with -11 during collectives") and "Segmentation fault" in r.detail


def test_verdict_fails_wrong_collective_results():
    bad = {
        "event": "done",
        "checks": {
            "quantized_all_gather": {"ok": False, "error": 1.0, "bound": 0.1, "detail": "max error 1 (bound 0.1)"}
        },
    }
    r = _verdict(_rank(0, STARTED, INIT, DONE), _rank(1, STARTED, INIT, bad))
    assert r.status is Status.FAIL and "rank 1 quantized_all_gather: max error 1 (bound 0.1)" in r.detail


# ------------------------------------------------------------------------------- one rank's checks
@pytest.fixture
def one_rank_world(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_rank_checks_pass_on_a_one_rank_world(one_rank_world):
    checks = rank.rank_checks(0, 1, torch.device("cpu"))
    assert set(checks) == {"all_gather", "reduce_scatter", "quantized_all_gather", "quantized_reduce_scatter"}
    assert all(c["ok"] for c in checks.values()), checks
    assert 0 < checks["quantized_all_gather"]["error"] <= checks["quantized_all_gather"]["bound"]


def test_rank_checks_catch_a_quantized_collective_beyond_its_bound(one_rank_world, monkeypatch):
    real = rank.quantized_all_gather

    def noisy(out, inp, *args, spec=None, **kw):
        real(out, inp, *args, spec=spec, **kw)
        if spec is not None:
            out[7] += 0.1  # about 6 times the bound (half an INT8 step of N(0, 1) data, ~0.016)
        return None

    monkeypatch.setattr(rank, "quantized_all_gather", noisy)
    checks = rank.rank_checks(0, 1, torch.device("cpu"))
    assert not checks["quantized_all_gather"]["ok"] and checks["all_gather"]["ok"]
    assert checks["quantized_all_gather"]["error"] > 4 * checks["quantized_all_gather"]["bound"]


TOPO = """\
\tGPU0\tGPU1\tGPU2\tNIC0\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV18\tPHB\tSYS\t0-31\t0
GPU1\tNV18\t X \tNV18\tSYS\t0-31\t0
GPU2\tPHB\tNV18\t X \tSYS\t32-63\t1
NIC0\tSYS\tSYS\tSYS\t X \t\t

Legend:
  NV#  = Connection traversing a bonded set of # NVLinks
"""


def test_nvlink_pairs_are_read_from_the_topology_matrix():
    assert system.nvlink_pairs(TOPO, 3) == 2  # 0-1 and 1-2; 0-2 is PCIe (PHB)
    assert system.nvlink_pairs(TOPO, 2) == 1
    assert system.nvlink_pairs(None, 3) is None


def test_ctrl_c_ends_the_run_with_one_line_and_no_report(tmp_path, monkeypatch, capsys):
    """Before: a KeyboardInterrupt traceback from the wait on the running check."""

    def interrupted(options: DoctorOptions, checks, progress=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run_checks", interrupted)
    assert cli.main(["--json", str(tmp_path / "d.json")]) == 130
    assert capsys.readouterr().err == "zeropp doctor: error: interrupted by SIGINT; no report written\n"
    assert not (tmp_path / "d.json").exists()


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--check-timeout", "inf"], "--check-timeout must be a number of seconds > 0 and <= 1e+09, got inf"),
        (["--world-timeout", "1e300"], "--world-timeout must be a number of seconds > 0 and <= 1e+09"),
        (["--check-timeout", "0"], "--check-timeout must be a number of seconds > 0"),
        (["--gloo-ranks", "99"], "--gloo-ranks must be an integer from 1 to 16, got 99"),
    ],
)
def test_bad_flags_are_usage_errors_naming_the_flag(argv, words, capsys):
    """Before: inf or 1e300 crashed the run with an OverflowError traceback from a thread's join,
    and the messages named the option's field (check_timeout_s), not the flag."""
    with pytest.raises(SystemExit) as e:
        cli.parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and words in err and "_s must" not in err


def test_a_master_addr_that_does_not_resolve_or_is_not_this_hosts_exits_2_before_any_check(monkeypatch, capsys):
    """Before: every rank waited out --world-timeout (60 s) and the gloo row blamed a hung init."""
    ran = []
    monkeypatch.setattr(cli, "CHECKS", [("ok", lambda o: ran.append(1) or ok_check(o))])
    for addr in ("nosuchhost.invalid", "192.0.2.1"):  # RFC 6761's never-resolving name; RFC 5737's TEST-NET-1
        with pytest.raises(SystemExit) as e:
            cli.main(["--master-addr", addr])
        assert e.value.code == 2, addr
    assert ran == []
    err = capsys.readouterr().err
    assert "--master-addr nosuchhost.invalid does not resolve" in err
    assert "--master-addr 192.0.2.1 (192.0.2.1) is not an address of this host" in err
    assert world.address_problem("127.0.0.1") is None and world.address_problem("localhost") is None
