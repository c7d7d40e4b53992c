"""The benchmarks as runner jobs: experiments/bench/fsdp.py (both trainers on the same problem)
and experiments/bench/cluster.py (its reading of the summaries; the full run needs namespaces).

Here: the end-to-end checks of this topic; its other tiers' checks are in
``tests/unit/test_runtime_bench.py``.
"""

from __future__ import annotations

import pytest

from tests.bench_helpers import cluster_summary
from zeropp.experiments.bench import cluster as bench_cluster
from zeropp.experiments.bench.fsdp import main
from zeropp.experiments.cluster.netns import NetnsError, require_privileges


def test_bench_fsdp_runs_both_trainers_on_the_same_problem(capsys):
    out = main(
        [
            "--world",
            "2",
            "--preset",
            "tiny",
            "--seq",
            "16",
            "--batch",
            "2",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--timeout",
            "120",
            "--device",
            "cpu",
        ]
    )
    text = capsys.readouterr().out
    assert "ours/FSDP2" in text and "step time" in text and "model-state memory" in text
    assert out["time_ratio"] > 0 and out["memory_ratio"] > 0
    # same model, data and optimizer: the two trainers compute the same losses (fp32)
    for a, b in zip(out["ours"]["losses"], out["fsdp2"]["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b)


def _netns_unavailable() -> str | None:
    try:
        require_privileges("zpp")
    except NetnsError as e:
        return f"bench_cluster needs network namespaces: {e}"
    return None


@pytest.mark.skipif(_netns_unavailable() is not None, reason=_netns_unavailable() or "")
def test_bench_cluster_end_to_end(tmp_path, capsys) -> None:
    code = bench_cluster.main(
        [
            "--gbps",
            "1",
            "--preset",
            "tiny",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--rounds",
            "1",
            "--timeout",
            "240",
            "--out",
            str(tmp_path),
            "--json",
            str(tmp_path / "b.json"),
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "ZeRO-3 step s" in text and "predicted vs measured speedup" in text
    assert sorted(p.parent.name for p in tmp_path.rglob("summary.json")) == ["zero3-0", "zeropp-0"]


def test_bench_cluster_alternates_the_modes(monkeypatch, tmp_path, capsys) -> None:
    """--rounds runs ZeRO-3 and ZeRO++ in turn, one runner job each, into their own directories.
    The jobs are fakes, so the kernel-rate timing that follows a mode's first jobs (a world of
    processes per mode, for the predictions this test does not read) is too; the real one runs in
    ``test_bench_cluster_end_to_end``."""
    calls: list[tuple[str, str]] = []

    def fake_job(overrides: list[str], run_dir) -> dict:
        quant = next(o.split("=")[1] for o in overrides if o.startswith("quant="))
        calls.append((quant, str(run_dir.relative_to(tmp_path))))
        return cluster_summary(quant, 0.5 if quant == "none" else 0.25, 0.1, 2e5)

    monkeypatch.setattr(bench_cluster, "run_job", fake_job)
    monkeypatch.setattr(bench_cluster, "require_privileges", lambda: None)
    monkeypatch.setattr(bench_cluster, "quant_rates_for", lambda summary: ())
    assert bench_cluster.main(["--gbps", "1,2", "--rounds", "2", "--out", str(tmp_path)]) == 0
    assert calls[:4] == [
        ("none", "1gbps/zero3-0"),
        ("zeropp", "1gbps/zeropp-0"),
        ("none", "1gbps/zero3-1"),
        ("zeropp", "1gbps/zeropp-1"),
    ]
    assert len(calls) == 8 and calls[4][1] == "2gbps/zero3-0"
    assert "| 2 (0.900) | 0.500 | 0.250 | 2.00x |" in capsys.readouterr().out
