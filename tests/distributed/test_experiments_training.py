"""Runner jobs whose subject is what the configured training does, not how it is launched: a resume
from a checkpoint continues exactly (the torch trainers' checkpoints, a tensor-parallel run's),
tensor parallelism trains on the data-parallel run's data with every byte counted, and the ZeRO
formula of a LoRA run with INT8 frozen weights equals the measured model state. Each job is
composed and validated from its overrides as the command line does it, and trained by the worker's
own loop on a gloo world forked from the tests' fork server (``tests.experiment_helpers.train_in_world``).

Here: the gloo-world checks of these jobs. The runner's command line, its spawned ranks and the
fault paths (a run stopped by a failing rank and resumed in its own directory, Ctrl-C, SIGTERM,
silent ranks) are ``tests/e2e/test_experiments_e2e.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.experiment_helpers import checkpoint_steps, rolled_back_copy, train_in_world
from tests.tp_helpers import tp_block_bytes

FAST = ["train.steps=4", "train.micro_batch_size=4", "model=tiny", "model.seq_len=32", "data.max_bytes=200000"]


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.parametrize("trainer", ["fsdp2", "ddp", "ddp_zeropp", "fsdp2_zeropp"])
def test_torch_trainers_resume_exactly(tmp_path: Path, trainer: str) -> None:
    """FSDP2 / DDP checkpoints go through torch.distributed.checkpoint too: a run resumed from the
    step-2 checkpoint of an uninterrupted run reaches that run's losses in fp32 (the uninterrupted
    run is the reference and wrote the checkpoint). fsdp2_zeropp runs INT4 gradients with error
    feedback and stochastic rounding, so the resume needs the residuals and the call counter each
    rank saved. ddp_zeropp (INT4 gradients) only nearly: DDP rebuilds its gradient buckets after its
    first iteration, so the resumed run's first step quantizes over the initial bucket layout, where
    the uninterrupted run used the rebuilt one."""
    quant = {
        "ddp_zeropp": ["quant=qgz"],
        "fsdp2_zeropp": ["quant=qgz", "zero.grads.error_feedback=true", "zero.grads.rounding=stochastic"],
    }
    common = ["topology=1x2", "logger=none", *FAST, f"trainer={trainer}", *quant.get(trainer, [])]
    ref, resumed = tmp_path / "ref", tmp_path / "resumed"
    train_in_world([*common, "train.checkpoint_every=2"], ref)
    assert checkpoint_steps(ref / "checkpoints") == (4, [2, 4])
    at2 = rolled_back_copy(ref / "checkpoints", 2, tmp_path / "at2")
    s = train_in_world([*common, "resume=true", f"train.checkpoint_dir={at2}"], resumed)
    assert s["first_step"] == 3 and s["steps"] == 2  # continued after the step-2 checkpoint
    want, got = _losses(ref), _losses(resumed)
    assert sorted(got) == [3, 4]
    if trainer == "ddp_zeropp":
        assert got[3] == want[3]
        assert got[4] == pytest.approx(want[4], rel=1e-3)
    else:
        assert [got[3], got[4]] == [want[3], want[4]]


def test_tensor_parallel_run_matches_the_data_parallel_run(tmp_path: Path) -> None:
    """``topology.tp=2``: 2 nodes x 2 ranks as tp=2 x dp=2 trains on the same data as 2 nodes x 1
    rank (the tp pair shares its batches), so the losses agree in fp32, and tokens per step count
    the dp ranks only; a tp run resumed from the uninterrupted tp run's step-2 checkpoint (each
    rank's TP-local shards) reaches its losses."""
    common = ["logger=none", *FAST, "stage=3", "quant=none", "train.eval_batches=2"]
    tp_topo = ["topology=2x2", "topology.tp=2"]
    runs = {
        "tp": train_in_world([*common, *tp_topo, "train.checkpoint_every=2"], tmp_path / "tp"),
        "dp": train_in_world([*common, "topology=2x1"], tmp_path / "dp"),
    }
    tp, dp = _losses(tmp_path / "tp"), _losses(tmp_path / "dp")
    assert sorted(tp) == sorted(dp) == [1, 2, 3, 4]
    for k in tp:
        assert abs(tp[k] - dp[k]) <= 1e-4 * abs(dp[k]), (k, tp[k], dp[k])
    assert abs(runs["tp"]["loss"]["eval"] - runs["dp"]["loss"]["eval"]) <= 1e-4 * runs["dp"]["loss"]["eval"]
    assert runs["tp"]["tokens_per_step"] == runs["dp"]["tokens_per_step"] == 2 * 4 * 32
    assert runs["tp"]["topology"]["tp"] == 2 and runs["dp"]["topology"]["tp"] == 1
    # every byte counted: the tensor-parallel all-reduces (DTensor's functional collectives) are the
    # intra-node traffic, 2 blocks x forward + backward of 4 x 32 tokens per rank and step, plus
    # the few bytes of the engine's control exchanges (all-to-alls on gloo); the dp run has no intra-node peer
    block = tp_block_bytes(4, 32, 32, tp=2)
    want = 2 * (block["forward"] + block["backward"])
    wire = runs["tp"]["comm_bytes_per_step"]
    assert want == wire["by_kind_link"]["all_reduce.intra"] < wire["by_link"]["intra"] < want + 256, wire
    assert runs["dp"]["comm_bytes_per_step"]["by_link"]["intra"] == 0
    # each rank's engine partitions its TP-local half of the split weights over the dp pair
    expected = sum(runs["tp"]["memory_expected"]["device"].values())
    assert runs["tp"]["memory_max_rank_bytes"] == expected < sum(runs["dp"]["memory_expected"]["device"].values())
    # resumed from its step-2 checkpoint: the tp run carries on exactly
    at2 = rolled_back_copy(tmp_path / "tp" / "checkpoints", 2, tmp_path / "at2")
    train_in_world([*common, *tp_topo, "resume=true", f"train.checkpoint_dir={at2}"], tmp_path / "resumed")
    assert _losses(tmp_path / "resumed") == {k: tp[k] for k in (3, 4)}  # exact in fp32


def test_lora_run_with_quantized_frozen_weights(tmp_path: Path) -> None:
    """``model.lora_rank`` + ``zero.quantize_frozen=int8``: the adapters train, and the summary's ZeRO
    formula (trained parameters' 16-byte share + the INT8 frozen shards' wire rows) equals the
    measured model state of every rank (2 nodes x 2 ranks)."""
    lora = ["logger=none", *FAST, "train.steps=2", "stage=3", "model.lora_rank=4", "zero.quantize_frozen=int8"]
    s = train_in_world(lora, tmp_path / "plain")
    expected = s["memory_expected"]["device"]
    assert len(s["memory_per_rank"]) == 4
    for rank_mem in s["memory_per_rank"]:
        assert {k: rank_mem[k] for k in ("params", "grads", "optimizer")} == expected, (rank_mem, expected)
    assert s["engine_comm_bytes_per_step"]["by_kind_link"]["frozen_all_gather.cross"] > 0
    # with hpZ the frozen shards' secondary copy (kept quantized) is in the formula too
    s = train_in_world([*lora, "zero.hpz=true"], tmp_path / "hpz")
    assert s["memory_max_rank_bytes"] == sum(s["memory_expected"]["device"].values())


@pytest.mark.parametrize(
    "extra",
    [
        ["zero.persistence_threshold=8192"],  # every parameter of model=tiny but the 8,192-element embedding
        ["zero.persistence_threshold=5000", "zero.offload_optimizer=cpu", "zero.precision=bf16"],
        ["zero.persistence_threshold=5000", "zero.offload_param=cpu"],
    ],
)
def test_persistent_parameters_are_in_the_formula(tmp_path: Path, extra: list[str]) -> None:
    """Stage-3 parameters under ``zero.persistence_threshold`` stay whole on every rank, with their
    whole optimizer state: the summary's (and memory.json's) ZeRO formula counts them so, and equals
    the measured model state per tier at the end of backward (before: they were counted as
    sharded, and offloaded by offload_param, so the formula was half the measured state or less)."""
    s = train_in_world(["logger=none", *FAST, "train.steps=1", "topology=1x2", "stage=3", *extra], tmp_path / "r")
    expected = s["memory_expected"]
    for phases in s["memory_by_phase"]:
        got = phases["backward"]["tiers"]
        for tier in expected:
            assert {c: got[tier][c] for c in expected[tier]} == pytest.approx(expected[tier]), (tier, got, expected)


@pytest.mark.parametrize(
    "extra",
    [
        ["topology=1x2", "zero.persistence_threshold=5000"],
        ["topology=2x2", "zero.persistence_threshold=5000", "zero.hpz=true", "zero.offload_optimizer=cpu"],
    ],
)
def test_the_memory_prediction_of_a_lora_run_with_a_persistence_threshold_is_what_it_measures(
    tmp_path: Path, extra: list[str]
) -> None:
    """``python -m experiments.memory``'s chosen row for LoRA at stage 3 with
    ``zero.persistence_threshold`` equals the model state each rank measures at the end of
    backward: frozen parameters under the threshold stay whole, outside the engine's frozen shards
    (before: the prediction counted them as sharded frozen state), and hpZ's secondary copy of the
    frozen shards is counted as the run's own formula counts it."""
    from tests.experiment_helpers import composed_config
    from zeropp.experiments.runner import memory as memcmd
    from zeropp.experiments.runner.config import from_dict

    overrides = ["logger=none", *FAST, "train.steps=1", "stage=3", "model.lora_rank=4", *extra]
    s = train_in_world(overrides, tmp_path / "r")
    chosen = next(r for r in memcmd.predictions(from_dict(composed_config(*overrides))) if r["chosen"])
    for phases in s["memory_by_phase"]:
        got = phases["backward"]["tiers"]
        for tier, want in chosen["by_tier"].items():
            assert {c: got[tier][c] for c in want} == pytest.approx(want), (tier, got, chosen["by_tier"])
