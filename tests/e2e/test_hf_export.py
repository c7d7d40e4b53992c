"""A GPT-2 and a Llama trained by the runner at stage 3 on 2 nodes x 2 ranks (the Llama also split
over ``topology.tp=2``, once more with tied embeddings and LoRA adapters, merged), exported (with ``python -m experiments.export``, and its library call), loaded with ``transformers``.

The exported model must be the trained one: its held-out loss on the runner's own final evaluation
batches equals the ``loss.eval`` the run reported (computed by the engine's ranks on the sharded,
tp-split model), and its logits equal those of our model holding the checkpoint's weights.
The one-process checks (LoRA, peft, the refusals) are ``tests/unit/test_hf_export.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.experiment_helpers import run_cli_here
from tests.hf_export_helpers import hf_logits, load_pretrained, our_logits, runner_eval_loss, tokens

REASON = 'Hugging Face models need the optional extra: pip install -e ".[hf]"'
TINY = ["model.d_model=32", "model.seq_len=32", "model.n_layers=2"]
FAST = ["train.steps=2", "train.micro_batch_size=4", "data.max_bytes=200000", "logger=none"]
MODELS = {
    "gpt2": ["model.hf_config=gpt2"],
    "llama-tp2": ["model.hf_config=llama", "model.n_heads=4", "model.n_kv_heads=2", "topology.tp=2"],
    # LoRA on a tp-split Llama whose frozen embedding is tied to the head (saved under one name)
    "llama-tp2-tied-lora": [
        "model.hf_config=llama",
        "model.n_heads=4",
        "model.n_kv_heads=2",
        "topology.tp=2",
        "model.tie_embeddings=true",
        "model.lora_rank=2",
    ],
}


def _python(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "ZEROPP_INJECT_FAULT"}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true")
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("name", list(MODELS))
def test_runner_stage3_2x2_run_exports_to_transformers(
    tmp_path: Path, name: str, capfd: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers", reason=REASON)
    from zeropp.models.hf_export import export_pretrained, hf_config_from_record
    from zeropp.runtime import read_consolidated

    run, out = tmp_path / "run", tmp_path / "hf"
    args = ["model=hf", *MODELS[name], *TINY, "stage=3", "topology=2x2", *FAST, "train.checkpoint_every=2"]
    args.append(f"hydra.run.dir={run}")
    # the command as typed once; the other the same cli() in this process (an interpreter less)
    p = _python(["zeropp.experiments.run", *args]) if name == "gpt2" else run_cli_here(args, capfd, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    latest = run / "checkpoints" / (run / "checkpoints" / "LATEST").read_text().strip()
    recorded = json.loads((latest / "meta.json").read_text())["extra"]["transformers_config"]  # what the export builds
    assert recorded["model_type"] == summary["config"]["model"]["hf_config"] and recorded["use_cache"] is False
    if name == "gpt2":  # the command once; the library call it wraps for the other (a process less)
        p = _python(["zeropp.experiments.export", str(run), str(out)])
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        assert "wrote" in p.stdout
    else:
        export_pretrained(run, out)
    assert (out / "model.safetensors").is_file()
    model = load_pretrained(out)
    want = summary["loss"]["eval"]
    assert want is not None and abs(runner_eval_loss(model, summary) - want) <= 1e-6 * abs(want)
    cfg = hf_config_from_record(summary["config"]["model"], run)
    state, _meta = read_consolidated(run / "checkpoints")
    if cfg.tie_embeddings:  # a frozen tied weight is saved under its first name only
        state.setdefault("hf.lm_head.weight", state["hf.model.embed_tokens.weight"])
    idx, _ = tokens(cfg, seed=1)
    got, ref = hf_logits(model, idx), our_logits(cfg, state, idx)
    if cfg.lora_rank:  # merged: W + s * B @ A rounds once per weight
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(got, ref)
