"""A diverging run stops as an error, end to end: every rank stops at the diverging step, the user
sees one message and exit status 3, ``summary.json`` says ``"status": "diverged"``, the metrics
line of that step is written, and no checkpoint of it exists (``train.checkpoint_every=1``: step
1 saves, step 2 diverges). One run per trainer family on the tiny model with 2 ranks:
``optim.lr=1e30`` makes the weights ~1e30 after step 1, so step 2's loss is NaN; fp16 with
``zero.loss_scale_init=1e30`` overflows on every step, under torchrun.

Here: the end-to-end checks of this topic; its other tiers' checks are in
``tests/unit/test_experiments_diverge.py``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.experiment_helpers import TINY_RUN, checkpoint_steps, run_cli, run_cli_here
from zeropp.experiments.runner.run import RunDiverged, run_job
from zeropp.runtime.divergence import EXIT_CODE

DIVERGES = [*TINY_RUN, "topology=1x2", "train.steps=5", "optim.lr=1e30", "train.checkpoint_every=1"]


def _check_outputs(run_dir: Path, step: int, reason: str) -> dict:
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["status"] == "diverged" and s["divergence"]["step"] == step and s["divergence"]["reason"] == reason
    assert s["steps"] == step and s["loss"]["eval"] is None
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["step"] == step and lines[-1]["skipped"] is True
    assert not math.isfinite(lines[-1]["grad_norm"])
    return s


def test_zeropp_fp32_divergence_is_one_error_and_saves_nothing(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    p = run_cli_here([*DIVERGES, "stage=3", f"hydra.run.dir={tmp_path}"], capfd)
    assert p.returncode == EXIT_CODE, p.stderr[-3000:]
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    want = (
        "error: training diverged at step 2: loss=nan, gradient norm=nan (the loss is not finite). To fix: "
        "lower optim.lr (now 1e+30), clip harder (zero.grad_clip is 1), or check the data for bad values. "
        f"Nothing of step 2 was saved; the newest checkpoint, of step 1, is in {tmp_path / 'checkpoints'}."
    )
    assert errors == [want], p.stderr[-3000:]
    assert "Traceback" not in p.stderr and "rank 1" not in p.stderr
    s = _check_outputs(tmp_path, 2, "non_finite")
    assert s["divergence"]["loss"] == "nan" and s["divergence"]["grad_norm"] == "nan" and s["skipped_steps"] == 1
    assert checkpoint_steps(tmp_path / "checkpoints") == (1, [1])
    # the default transport on 2 CPU ranks of one host: the shared memory, said at start-up and recorded
    assert "zeropp: zero.transport=auto -> shm (2 CPU ranks on one host with room for the region)" in p.stderr
    assert s["transport"] == {
        "requested": "auto",
        "resolved": "shm",
        "reason": "2 CPU ranks on one host with room for the region",
    }


@pytest.mark.parametrize("trainer", ["ddp", "fsdp2"])
def test_torch_trainers_skip_and_stop_the_same_way(tmp_path: Path, trainer: str) -> None:
    with pytest.raises(RunDiverged) as ei:  # a RankFailure: sweeps that record failed runs record it
        run_job([*DIVERGES, f"trainer={trainer}", "launcher.progress=false"], tmp_path)
    assert ei.value.divergence.step == 2 and ei.value.exit_code == EXIT_CODE and ei.value.rank == 0
    assert str(ei.value).startswith("training diverged at step 2: loss=nan, gradient norm=nan")
    _check_outputs(tmp_path, 2, "non_finite")
    assert checkpoint_steps(tmp_path / "checkpoints") == (1, [1])


def test_fp16_overflow_streak_stops_a_torchrun_job(tmp_path: Path) -> None:
    p = run_cli(
        [
            *TINY_RUN,
            "topology=1x2",
            "train.steps=5",
            "zero.precision=fp16",
            "zero.loss_scale_init=1e30",
            "train.max_skipped_steps=2",
            f"hydra.run.dir={tmp_path}",
        ],
        torchrun_ranks=2,
    )
    assert p.returncode != 0
    # the ranks exit with the divergence status (torchrun then stops any left and exits 1 itself);
    # rank 0 alone says why
    assert "exitcode  : 3" in p.stderr and "exitcode  : 1" not in p.stderr, p.stderr[-3000:]
    assert (
        p.stderr.count(
            "error: training diverged at step 2: 2 consecutive steps skipped for fp16 overflow "
            "(train.max_skipped_steps=2)"
        )
        == 1
    ), p.stderr[-3000:]
    s = _check_outputs(tmp_path, 2, "skipped_streak")
    assert s["divergence"]["skipped_streak"] == 2 and s["skipped_steps"] == 2
