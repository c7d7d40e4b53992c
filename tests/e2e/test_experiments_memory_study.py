"""``python -m experiments.memory_study``: the per-phase memory study of a plain MLP, at a tiny size.

One 4-rank run (width 8, 3 layers: Ψ = 216, so every unit splits evenly over N = 4 and the
formula holds to the byte) through ``main``: every rank's model state at the end of backward
equals ZeRO's formula computed here by hand, for stage 0, ZeRO-1/2/3 and ZeRO-3 with CPU offload;
the phases hold what ``zeropp.runtime.memory.PHASES`` says; the table, the PNG and the JSON are
written. Without processes: a measurement that differs from the formula is reported and exits 1,
the formula texts for bf16, and bad options refused (exit 2) before any rank starts.

Here: the end-to-end checks of this topic; its other tiers' checks are in
``tests/unit/test_experiments_memory_study.py``.
"""

from __future__ import annotations

import contextlib
import io

import pytest

from zeropp.experiments import memory_study as ms
from zeropp.runtime.memory import MODEL_STATE, tier_totals

FAST = ["--width", "8", "--layers", "3", "--batch", "4"]
PSI, N = 3 * (8 * 8 + 8), 4
FP32 = {  # fp32, the master being the weight: (device, host) bytes per rank, by hand from the formulas
    "stage 0 (replicated)": (16 * PSI, 0),  # 16Ψ
    "ZeRO-1": (8 * PSI + 8 * PSI // N, 0),  # 8Ψ + 8Ψ/N
    "ZeRO-2": (4 * PSI + 12 * PSI // N, 0),  # 4Ψ + 12Ψ/N
    "ZeRO-3": (16 * PSI // N, 0),  # 16Ψ/N
    "ZeRO-3 + CPU offload": (4 * PSI // N, 20 * PSI // N),  # grads 4Ψ/N | params 4Ψ/N + optimizer 12Ψ/N + fp32 grads 4Ψ/N
}
TEXTS = {"stage 0 (replicated)": ("16Ψ", "0"), "ZeRO-1": ("8Ψ + 8Ψ/N", "0"), "ZeRO-2": ("4Ψ + 12Ψ/N", "0"),
         "ZeRO-3": ("16Ψ/N", "0"), "ZeRO-3 + CPU offload": ("4Ψ/N", "20Ψ/N")}


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = ms.main([*FAST, "--out", str(out)])
    return result, out, printed.getvalue()


def test_every_rank_matches_the_formula_computed_by_hand(study) -> None:
    result, _, _ = study
    assert result["num_params"] == PSI
    assert [r["label"] for r in result["runs"]] == list(FP32)
    for run in result["runs"]:
        assert len(run["ranks"]) == N
        for phases in run["ranks"]:
            got = tier_totals(phases["backward"]["tiers"], MODEL_STATE)
            assert (got["device"], got["host"], got["disk"]) == (*FP32[run["label"]], 0), (run["label"], got)
        assert run["matches"] and run["check"] == "matches the formula", run["check"]
        assert (run["formula"]["device"], run["formula"]["host"]) == TEXTS[run["label"]]
    assert result["runs"][3]["units"] == 3  # ZeRO-3 gathers each Linear apart (the Sequential default)


