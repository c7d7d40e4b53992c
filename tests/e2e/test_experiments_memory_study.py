"""``python -m experiments.memory_study``: the per-phase memory study of a plain MLP, at a tiny size.

One 4-rank run (width 8, 3 layers: Ψ = 216, so every unit splits evenly over N = 4 and the
formula holds to the byte) through ``main``: every rank's model state at the end of backward
equals ZeRO's formula computed here by hand, for stage 0, ZeRO-1/2/3 and ZeRO-3 with CPU offload;
the phases hold what ``zeropp.runtime.memory.PHASES`` says; the table, the PNG and the JSON are
written. Without processes: a measurement that differs from the formula is reported and exits 1,
the formula texts for bf16, and bad options refused (exit 2) before any rank starts.

Here: the end-to-end checks of this topic; its other tiers' checks are in ``tests/unit/test_experiments_memory_study.py``.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from tests.experiment_helpers import legends_over_data
from zeropp.experiments.studies import memory_study as ms
from zeropp.experiments.studies import memory_study_views as msv
from zeropp.runtime.memory import MODEL_STATE, TIERS, tier_totals

FAST = ["--width", "8", "--layers", "3", "--batch", "4"]
PSI, N = 3 * (8 * 8 + 8), 4
FP32 = {  # fp32, the master being the weight: (device, host) bytes per rank, by hand from the formulas
    "stage 0 (replicated)": (16 * PSI, 0),  # 16Ψ
    "ZeRO-1": (8 * PSI + 8 * PSI // N, 0),  # 8Ψ + 8Ψ/N
    "ZeRO-2": (4 * PSI + 12 * PSI // N, 0),  # 4Ψ + 12Ψ/N
    "ZeRO-3": (16 * PSI // N, 0),  # 16Ψ/N
    "ZeRO-3 + CPU offload": (
        4 * PSI // N,
        20 * PSI // N,
    ),  # grads 4Ψ/N | params 4Ψ/N + optimizer 12Ψ/N + fp32 grads 4Ψ/N
}
TEXTS = {
    "stage 0 (replicated)": ("16Ψ", "0"),
    "ZeRO-1": ("8Ψ + 8Ψ/N", "0"),
    "ZeRO-2": ("4Ψ + 12Ψ/N", "0"),
    "ZeRO-3": ("16Ψ/N", "0"),
    "ZeRO-3 + CPU offload": ("4Ψ/N", "20Ψ/N"),
}


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


def test_each_phase_holds_what_it_says(study) -> None:
    result, _, _ = study
    for run in result["runs"]:
        for ph in run["ranks"]:
            assert list(ph) == ["model_creation", "optimizer_creation", "forward", "backward", "step"]
            tiers = {k: v["tiers"] for k, v in ph.items()}
            for t in TIERS:
                assert tiers["model_creation"][t]["optimizer"] == 0  # the engine allocates it with the optimizer
                assert tiers["optimizer_creation"][t]["optimizer"] == tiers["backward"][t]["optimizer"]
            assert tiers["forward"]["device"]["activations"] > 0 == tiers["backward"]["device"]["activations"]
            stage = run["zero"]["stage"]
            full_grads = tiers["backward"]["device"]["grads"]
            # full gradients exist from backward to the step at stages 0-1; the 2-3 shard is there throughout
            assert tiers["step"]["device"]["grads"] == (0 if stage < 2 else full_grads)


def test_table_plot_and_json_are_written(study) -> None:
    result, out, printed = study
    assert printed.count("matches the formula") == len(ms.CONFIGS), printed
    assert "optimizer_creation" in printed and "8Ψ + 8Ψ/N" in printed and "ZeRO-3 + CPU offload" in printed
    assert (out / "memory_study.png").read_bytes()[:4] == b"\x89PNG"
    import matplotlib.pyplot as plt

    fig = msv.figure(result)  # the PNG's figure: its legend under the panels, never over a bar
    try:
        assert len(fig.legends) == 1 and legends_over_data(fig) == []
        assert [ax.get_title().split("\n")[0] for ax in fig.axes] == [label for label, _ in ms.CONFIGS]
        assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == [
            "model\ncreation",
            "optimizer\ncreation",
            "forward",
            "backward",
            "step",
        ]
        assert fig.axes[0].get_ylabel() == "MiB per rank"
    finally:
        plt.close(fig)
    assert json.loads((out / "memory_study.json").read_text()) == json.loads(json.dumps(result))


def _per_rank(result: dict) -> list[list[dict]]:
    """``study_rank``'s return values, rebuilt from a result."""
    return [
        [{"label": run["label"], "units": run["units"], "phases": run["ranks"][r]} for run in result["runs"]]
        for r in range(len(result["runs"][0]["ranks"]))
    ]


def test_a_measurement_off_the_formula_is_reported_and_fails(study, monkeypatch, capsys, tmp_path) -> None:
    result, _, _ = study
    per_rank = json.loads(json.dumps(_per_rank(result)))
    per_rank[1][2]["phases"]["backward"]["tiers"]["device"]["grads"] += 64  # rank 1, ZeRO-2: 64 bytes too many
    cfg = ms.StudyConfig(width=8, layers=3, batch=4, tolerance=0.0)
    bad = ms.summarize(cfg, per_rank)
    assert [r["matches"] for r in bad["runs"]] == [True, True, False, True, True]
    assert bad["runs"][2]["check"] == f"rank 1 differs: device +64 B (+{64 / (4 * PSI + 12 * PSI // N):.1%})"
    # within the tolerance it is a match
    assert ms.summarize(ms.StudyConfig(width=8, layers=3, batch=4, tolerance=0.05), per_rank)["runs"][2]["matches"]
    monkeypatch.setattr(ms, "run_study", lambda cfg: bad)
    with pytest.raises(SystemExit) as e:
        ms.main([*FAST, "--out", str(tmp_path)])
    assert e.value.code == 1 and "ZeRO-2 differ(s) from ZeRO's formula" in capsys.readouterr().err
