"""Shared inputs of the benchmark tests: the smallest ``bench_gpu`` configuration on CPU, and a
``summary.json`` as the runner writes it for a ``bench_cluster`` job."""

from __future__ import annotations

CPU_TINY = [
    "--device",
    "cpu",
    "--preset",
    "tiny",
    "--d-model",
    "0",
    "--n-layers",
    "0",
    "--n-heads",
    "0",
    "--seq",
    "16",
    "--batch",
    "2",
    "--steps",
    "2",
    "--warmup",
    "1",
]


def cluster_summary(quant: str, step: float, wait: float, cross: float) -> dict:
    """A summary.json as the runner writes it for a bench_cluster job (the fields the bench reads)."""
    spec = {
        "bits": 8,
        "group_size": None,
        "rounding": "nearest",
        "intra_bits": None,
        "error_feedback": False,
        "seed": 0,
        "scheme": "int",
    }
    zero = {
        "stage": 3,
        "precision": "fp32",
        "hpz": quant == "zeropp",
        "hpz_size": None,
        "grad_accum_steps": 1,
        "weights": spec if quant == "zeropp" else None,
        "grads": {**spec, "bits": 4} if quant == "zeropp" else None,
    }
    cfg = {
        "zero": zero,
        "model": {"vocab_size": 256, "seq_len": 16, "d_model": 32, "n_layers": 2, "n_heads": 2, "mlp_ratio": 4},
        "topology": {"nodes": 2, "ranks_per_node": 2, "hpz_size": None},
        "train": {"micro_batch_size": 2},
        "trainer": {"name": "zeropp"},
        "cluster": {"name": "emulated", "inter_gbps": 1.0, "inter_latency_ms": 0.0},
    }
    return {
        "config": cfg,
        "step_time_s": {"median": step, "mean": step},
        "engine_comm_wait_s_per_step": wait,
        "comm_wait_s_per_step": wait,
        "engine_comm_bytes_per_step": {"by_link": {"cross": cross, "intra": 1.0}},
        "placement": {"cluster": "emulated", "measured_gbps": 0.9},
        "model": {"params": 30_000, "flops_per_token": 1.0},
        "loss": {"first": 5.6, "final": 5.5},
        "run_dir": "x",
    }
