"""The runner with Hugging Face models.

Here: the end-to-end checks. The topic's full description and its one-process checks are in
``tests/unit/test_experiments_hf.py``.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.experiment_helpers import run_cli_here
from zeropp.models import HFConfig

REASON = 'Hugging Face models need the optional extra: pip install -e ".[hf]"'
TINY = ["model.d_model=32", "model.seq_len=32", "model.n_layers=2"]
FAST = ["train.steps=2", "train.micro_batch_size=4", "data.max_bytes=200000", "logger=none"]
# two ranks, not four: each rank imports transformers (seconds of CPU); the 2x2 parity is tests/distributed/test_models_hf.py


def _summary(tmp: Path, p: subprocess.CompletedProcess) -> dict[str, Any]:
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads((tmp / "summary.json").read_text())


def test_runner_trains_hf_gpt2_from_the_command_line(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers", reason=REASON)
    s = _summary(
        tmp_path,
        run_cli_here(
            [
                "model=hf",
                "model.hf_config=gpt2",
                *TINY,
                "stage=3",
                "quant=zeropp",
                "topology=2x1",
                *FAST,
                f"hydra.run.dir={tmp_path}",
            ],
            capfd,
            timeout=240,
        ),
    )
    m = s["config"]["model"]
    assert m["kind"] == "hf" and m["hf_config"] == "gpt2" and m["d_model"] == 32
    cfg = HFConfig(**{k: v for k, v in m.items() if k != "kind"})
    assert s["model"]["params"] == cfg.num_params()
    assert len(s["loss"]["curve"]) == 2 and 0 < s["loss"]["final"] < 6
    assert s["comm_bytes_per_step"]["by_link"]["cross"] > 0


def test_runner_trains_hf_llama_from_a_local_checkpoint(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers", reason=REASON)
    from zeropp.models import build_hf_model

    cfg = HFConfig(hf_config="llama", d_model=32, seq_len=32, n_layers=2, n_heads=4, n_kv_heads=2)
    ckpt = tmp_path / "ckpt"
    build_hf_model(cfg, seed=11).hf.save_pretrained(ckpt)
    run = tmp_path / "run"
    s = _summary(
        run,
        run_cli_here(
            [
                "model=hf",
                "model.hf_config=llama",
                *TINY,
                "model.n_heads=4",
                "model.n_kv_heads=2",
                f"model.pretrained={ckpt}",
                "stage=2",
                "quant=qgz",
                "topology=1x2",
                *FAST,
                f"hydra.run.dir={run}",
            ],
            capfd,
            timeout=240,
        ),
    )
    assert s["config"]["model"]["pretrained"] == str(ckpt) and s["config"]["model"]["n_kv_heads"] == 2
    assert s["model"]["params"] == cfg.num_params() and len(s["loss"]["curve"]) == 2
