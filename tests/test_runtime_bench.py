"""Smoke test of experiments/bench_fsdp.py: both worlds run and agree on the losses (no timing asserts)."""

from experiments.bench_fsdp import main


def test_bench_fsdp_runs_both_trainers_on_the_same_problem(capsys):
    out = main(["--world", "2", "--preset", "tiny", "--seq", "16", "--batch", "2", "--steps", "2", "--warmup", "1",
                "--timeout", "120"])
    text = capsys.readouterr().out
    assert "ours/FSDP2" in text and "step time" in text and "peak memory" in text
    assert out["time_ratio"] > 0 and out["memory_ratio"] > 0
    # same model, data and optimizer: the two trainers compute the same losses (fp32)
    for a, b in zip(out["ours"]["losses"], out["fsdp2"]["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b)
