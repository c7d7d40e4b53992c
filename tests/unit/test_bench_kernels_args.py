"""``python -m experiments.bench_kernels``'s command line: every value that would hang the size
loop, crash inside torch or time nothing is a usage error (exit 2) naming the flag, before any
tensor is made."""

from __future__ import annotations

import pytest

from zeropp.experiments.bench import kernels as bench_kernels

CASES = [
    (["--min-kib", "0"], "--min-kib must be a finite size > 0, got 0"),  # before: the size loop never ended
    (["--min-kib", "0.0001"], "--min-kib 0.0001 is below one byte"),  # 0 bytes after rounding: the same hang
    (["--min-kib", "-4"], "--min-kib must be a finite size > 0, got -4"),
    (["--max-mib", "0"], "--max-mib must be a finite size > 0, got 0"),  # before: rows of 0 bytes
    (["--max-mib", "inf"], "--max-mib must be a finite size > 0, got inf"),
    (["--min-kib", "4096", "--max-mib", "1"], "--min-kib 4096 is above --max-mib 1"),  # before: timed 1 MiB alone
    (["--iters", "0"], "--iters must be >= 1, got 0"),
    (["--warmup", "-1"], "--warmup must be >= 0, got -1"),
    (["--k", "0"], "--k must be >= 1, got 0"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--device", "gpu"], "--device 'gpu' is not a device; use cpu or cuda"),
    (["--device", "meta"], "--device meta: the benchmark times the CPU path or the Triton kernels"),
    (["--device", "cpu:1"], "--device cpu:1: there is one CPU device; use --device cpu"),
]


@pytest.mark.parametrize("argv,msg", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_arguments_are_usage_errors_naming_the_flag(argv: list[str], msg: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        bench_kernels.parse_args(["--device", "cpu", *argv])
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_cuda_without_a_gpu_is_a_usage_error(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setattr(bench_kernels.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        bench_kernels.parse_args(["--device", "cuda"])
    assert e.value.code == 2 and "torch sees no CUDA device here; use --device cpu" in capsys.readouterr().err


def test_a_gpu_index_this_host_lacks_is_a_usage_error(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setattr(bench_kernels.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench_kernels.torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit) as e:  # before: a traceback from the first allocation on cuda:1
        bench_kernels.parse_args(["--device", "cuda:1"])
    assert e.value.code == 2 and "torch sees 1 CUDA device(s) here, cuda:0 to cuda:0" in capsys.readouterr().err


def test_the_cpu_defaults_pass() -> None:
    a = bench_kernels.parse_args(["--device", "cpu"])
    assert (a.min_kib, a.max_mib, a.iters, a.warmup) == (64.0, 64.0, 10, 2)
    assert bench_kernels._sizes(a.min_kib, a.max_mib)[-1] == 64 << 20


def test_the_size_ladder_refuses_a_start_that_cannot_grow() -> None:
    with pytest.raises(ValueError, match="need 1 byte <= smallest <= largest"):
        bench_kernels._sizes(0.0, 1.0)


def test_a_largest_size_beyond_the_devices_memory_is_a_usage_error(monkeypatch, capsys) -> None:
    """Before: the smaller sizes ran, then the allocator's traceback or the out-of-memory killer."""
    from zeropp.experiments.runner import preflight

    monkeypatch.setattr(preflight, "host_memory", lambda: 4 << 30)
    with pytest.raises(SystemExit) as e:
        bench_kernels.parse_args(["--device", "cpu", "--max-mib", "1024"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--max-mib 1024 (with --k 4) needs about 20.00 GiB on cpu but it has 4.00 GiB" in err
    assert bench_kernels.parse_args(["--device", "cpu", "--max-mib", "64"]).max_mib == 64
