"""``python -m experiments.memory``: ``memory.json``, the summary's per-phase memory and the report's
per-phase bars.

Here: the one-process checks. The topic's full description and its end-to-end checks are in
``tests/e2e/test_experiments_memory.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.experiment_helpers import composed_config
from zeropp.experiments.runner import memory as memcmd
from zeropp.experiments.runner.config import from_dict
from zeropp.experiments.runner.metrics import expected_model_state
from zeropp.models import GPT
from zeropp.runtime.memory import expected_by_tier, tier_totals

FAST = ["model=mini", "topology=2x2", "train.micro_batch_size=2", "data.max_bytes=200000"]


def test_predict_only_lists_every_stage_and_offload_choice(capsys):
    out = memcmd.main(["--predict-only", *FAST, "stage=3", "zero.precision=bf16"])
    rows = out["predicted"]
    assert out["measured"] is None
    assert [(r["stage"], r["offload_optimizer"], r["offload_param"]) for r in rows][:2] == [
        (0, "none", "none"),
        (1, "none", "none"),
    ]
    assert len(rows) == 1 + 3 + 3 + 9
    assert [r["chosen"] for r in rows].count(True) == 1 and rows[7]["chosen"] and rows[7]["stage"] == 3
    from zeropp.models import GPTConfig

    psi = GPTConfig.preset("mini").num_params()
    for r in rows:
        want = tier_totals(
            expected_by_tier(
                r["stage"], psi, 4, offload_optimizer=r["offload_optimizer"], offload_param=r["offload_param"]
            )
        )
        assert r["tiers"] == want
        assert (r["swap_buffers_host"] > 0) == ("nvme" in (r["offload_optimizer"], r["offload_param"]))
    text = capsys.readouterr().out
    assert "| *3 | none | none |" in text and "| 3 | nvme | nvme |" in text and f"{psi:,}" in text


def test_bad_override_is_refused_before_anything_runs(capsys):
    with pytest.raises(SystemExit) as e:
        memcmd.main(["--predict-only", "precision=bf16"])
    assert e.value.code == 2 and "precision" in capsys.readouterr().err


def test_trainers_without_phases_get_flat_snapshots():
    """DDP / FSDP2 (TorchTrainer) keep no per-phase accounting: their ``memory_phases()`` is the flat
    model-state report after model creation (parameters only) and at the end of the last step
    (parameters, gradients, AdamW's two moments), all on the device."""
    from zeropp.experiments.runner.config import from_dict
    from zeropp.experiments.runner.torch_trainers import TorchTrainer
    from zeropp.experiments.runner.trainers import build_model

    cfg = from_dict(
        {
            "model": {"n_layers": 1, "d_model": 16, "n_heads": 2, "vocab_size": 64, "seq_len": 8},
            "data": {"kind": "random"},
            "trainer": {"name": "ddp"},
            "topology": {"nodes": 1, "ranks_per_node": 1},
        }
    )
    model = build_model(cfg, torch.device("cpu"))
    pbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    trainer = TorchTrainer(model, cfg, autocast=False)
    before = trainer.memory_phases()
    assert list(before) == ["model_creation", "step"] and before["model_creation"].to_dict()["total"] == pbytes
    batch = [(torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8)))]
    trainer.train_step(batch)
    trainer.train_step(batch)  # measured at the end of backward: AdamW's states are the first step's
    ph = {k: v.to_dict() for k, v in trainer.memory_phases().items()}
    assert list(ph) == ["model_creation", "step"]
    assert ph["model_creation"]["total"] == pbytes  # taken once, at creation
    dev = ph["step"]["tiers"]["device"]
    moments_and_steps = 2 * pbytes + 4 * len(trainer.opt.state)  # exp_avg, exp_avg_sq, a float32 step each
    assert (dev["params"], dev["grads"], dev["optimizer"]) == (pbytes, pbytes, moments_and_steps)
    assert ph["step"]["tier_totals"]["host"] == 0
    assert trainer.frozen_bytes() == 0 and trainer.trained_params() is None


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.lora_rank=4", "stage=3"],  # the frozen base: no gradient, no optimizer state
        ["quant=zeropp", "zero.precision=bf16"],  # hpZ's secondary kept as qwZ's INT8 wire rows
        ["model.lora_rank=4", "stage=2", "zero.offload_optimizer=cpu"],
        ["zero.persistence_threshold=4000", "zero.offload_optimizer=cpu", "zero.offload_param=cpu"],  # kept whole
    ],
)
def test_the_chosen_row_is_the_model_state_the_run_reports(overrides):
    """The predicted row marked ``*`` is what the run's ``memory.json`` will hold as ``expected``
    (``metrics.expected_model_state``, given the trainable count and the frozen shard the engine
    reports). Before, the table counted a LoRA base's gradients and Adam states and hpZ's copy at
    the compute dtype, and stage-3 parameters under ``zero.persistence_threshold`` as sharded and
    offloaded, so its ``measured / predicted`` ratios were wrong exactly where a study looks."""
    rc = from_dict(composed_config(*FAST, *overrides))
    chosen = next(r for r in memcmd.predictions(rc) if r["chosen"])
    psi = rc.model.num_params()
    frozen = rc.model.with_(lora_rank=0).num_params() if rc.model.lora_rank else 0
    shard = rc.topology.world_size if rc.zero.stage == 3 else 1
    threshold = rc.zero.persistence_threshold  # the engine's rule, on the real model's parameters
    whole = sum(p.numel() for p in GPT(rc.model).parameters() if p.requires_grad and p.numel() < threshold)
    want = expected_model_state(
        rc, psi - frozen, frozen_bytes=frozen * rc.zero.dtype.itemsize // shard, replicated=whole
    )
    assert want is not None
    for tier in want:
        assert chosen["by_tier"][tier] == pytest.approx(want[tier]), (tier, chosen["by_tier"], want)


@pytest.mark.parametrize("trainer, stage", [("ddp", 0), ("fsdp2", 3)])
def test_the_chosen_row_of_a_trainer_with_a_fixed_stage_is_that_stage(trainer, stage, capsys):
    """DDP replicates everything and FSDP2 shards everything whatever ``stage`` says: the ``*`` row
    is the trainer's (before: the default stage=3 row was marked for DDP)."""
    rows = memcmd.main(["--predict-only", *FAST, f"trainer={trainer}"])["predicted"]
    assert [(r["stage"], r["offload_optimizer"], r["offload_param"]) for r in rows if r["chosen"]] == [
        (stage, "none", "none")
    ]
    assert f"| *{stage} | none | none |" in capsys.readouterr().out


def test_a_measured_run_the_runner_refuses_is_one_error_line(tmp_path, capsys):
    """The short run's refusals before any rank (here a --run-dir that holds an earlier run) end the
    command with the runner's one error line and exit 2 (before: a RunDirTaken traceback, exit 1),
    and the earlier run is untouched."""
    (tmp_path / "summary.json").write_text('{"mine": true}')
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(SystemExit) as e:
        memcmd.main([*FAST, "--run-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.startswith("error: invalid config: ") and "already holds a run" in err and "--run-dir" in err, err
    assert "Traceback" not in err and (tmp_path / "summary.json").read_text() == '{"mine": true}'


def test_tensor_parallel_with_a_persistence_threshold_is_refused_in_one_line(capsys):
    """Which parameters stay whole under ``zero.persistence_threshold`` depends on their
    tensor-parallel slices, which the formula (Ψ/tp) does not see: refused, exit 2, naming both keys
    and what to do instead (before: the whole model's count under the threshold was taken from one
    rank's Ψ/tp, a wrong row marked as the run's)."""
    with pytest.raises(SystemExit) as e:
        memcmd.main(["--predict-only", *FAST, "stage=3", "topology.tp=2", "zero.persistence_threshold=4000"])
    assert e.value.code == 2
    out = capsys.readouterr()
    assert out.out == "" and len(out.err.strip().splitlines()) == 1
    assert "cannot predict topology.tp=2 with zero.persistence_threshold=4000" in out.err
