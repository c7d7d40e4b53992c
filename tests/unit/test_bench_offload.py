"""``python -m experiments.bench_offload``'s pieces on tiny sizes: the AdamW rows (zeropp's native
kernel, torch's, DeepSpeed's or the install hint), the size list, the table and the whole command.

Here: the one-process checks with DeepSpeed made unimportable. The DeepSpeed row itself (its op
is built at first use, minutes) is checked in ``tests/e2e/test_bench_offload.py``.
"""

from __future__ import annotations

import sys

import pytest
import torch

from zeropp.experiments.bench import offload as bench
from zeropp.kernels import cpu_adamw


@pytest.fixture
def no_deepspeed(monkeypatch: pytest.MonkeyPatch) -> None:
    """``import deepspeed`` fails here as it does where it is not installed."""
    for mod in ("deepspeed", "deepspeed.ops", "deepspeed.ops.adam"):
        monkeypatch.setitem(sys.modules, mod, None)


def test_rows_without_deepspeed_say_how_to_install_it(no_deepspeed: None) -> None:
    rows = bench.bench_adam(4097, 2, bench.runners())
    by = {r["kernel"]: r for r in rows}
    assert set(by) == {"single", "foreach", "fused", "native", "native-exact", "deepspeed"}
    assert by["deepspeed"] == {"kernel": "deepspeed", "numel": 4097, "skipped": bench.PEERS_HINT}
    assert by["single"]["max_abs_diff"] == 0.0  # the reference's own arithmetic
    if cpu_adamw.available():
        assert by["native"]["max_abs_diff"] <= 1e-6 and by["native"]["vs_fused"] > 0
        if cpu_adamw.torch_sqrt() is not None:
            assert by["native-exact"]["max_abs_diff"] == 0.0
    assert by["fused"]["vs_fused"] == 1.0 and by["fused"]["vs_deepspeed"] is None
    table = "\n".join(bench.adam_table(rows, 2, 2))
    assert "2 threads for every kernel, median of 2 interleaved steps" in table
    assert "| 4097 | deepspeed | skipped: DeepSpeed: pip install 'zeropp[peers]' |" in table


def test_sizes_parse_and_bad_ones_are_refused(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.parse_args(["--sizes", "1M,4k,17", "--dir", str(tmp_path)]).numels == [1 << 20, 4096, 17]
    assert bench.parse_args(["--dir", str(tmp_path)]).numels == [1 << 20, 4 << 20, 16 << 20, 64 << 20]
    for bad in ("0", "4X", "1M,,2", "-3"):
        with pytest.raises(SystemExit) as e:
            bench.parse_args(["--sizes", bad, "--dir", str(tmp_path)])
        assert e.value.code == 2
        assert "--sizes:" in capsys.readouterr().err


def test_the_command_prints_both_tables(no_deepspeed: None, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    try:
        assert bench.main(["--sizes", "1k", "--repeat", "1", "--threads", "1", "--swap-mib", "1",
                           "--buffers", "2", "--buffer-size", "1024", "--dir", str(tmp_path)]) == 0  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "1 threads for every kernel" in out and "| 1024 | native |" in out
    assert "Swap vs plain sequential I/O, 1 MiB" in out and "SwappedAdamW step, 1024 elements" in out
    assert list(tmp_path.iterdir()) == []  # the swap test removed its files


def test_rounds_are_shuffled_so_no_kernel_always_follows_the_same_one() -> None:
    """The kernels share the buffers, so the one before a kernel decides whether it finds them in
    the cache: over the timed steps, each kernel runs right after each of the others."""
    log: list[str] = []

    def kernel(name: str):
        return lambda p, g, m, v, s, lr: log.append(name)

    names, repeat = ["fused", "x", "y"], 8
    rows = bench.bench_adam(64, repeat, {k: kernel(k) for k in names})
    assert [r["kernel"] for r in rows] == names  # the table keeps the kernels' order
    timed = log[-3 * repeat :]  # after the parity checks (3 steps each) and one warm-up step each
    rounds = [timed[i : i + 3] for i in range(0, len(timed), 3)]
    assert all(sorted(r) == sorted(names) for r in rounds)
    assert len({tuple(r) for r in rounds}) > 1
    after = {(a, b) for a, b in zip(timed, timed[1:]) if a != b}
    assert after == {(a, b) for a in names for b in names if a != b}


def test_sizes_beyond_host_memory_and_a_swap_beyond_the_disk_are_refused(monkeypatch, capsys, tmp_path) -> None:
    """Before: the out-of-memory killer ended the benchmark (SIGKILL, no message), and a swap test
    larger than the disk died in the middle of writing."""
    from zeropp.experiments.bench import offload

    monkeypatch.setattr(offload, "host_memory", lambda: 1 << 30)  # 1 GiB
    with pytest.raises(SystemExit) as e:
        offload.parse_args(["--sizes", "64M", "--swap-mib", "0"])
    assert e.value.code == 2 and "67,108,864 elements need about 2.00 GiB of host memory" in capsys.readouterr().err
    assert offload.parse_args(["--sizes", "16M", "--swap-mib", "0"]).numels == [16 << 20]

    class Usage:
        free = 100 << 20

    monkeypatch.setattr(offload.shutil, "disk_usage", lambda path: Usage)
    with pytest.raises(SystemExit) as e:
        offload.parse_args(["--sizes", "1k", "--swap-mib", "64", "--dir", str(tmp_path)])
    assert e.value.code == 2 and "--swap-mib 64 writes about 128.00 MiB to --dir" in capsys.readouterr().err
