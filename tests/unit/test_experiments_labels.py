"""Run labels of a sweep (``experiments.projection.labels.label_runs``) and the report's figures that use them.

Each sweep is composed by Hydra and validated as the runner would (``composed_sweep``: no rank
starts), so the labels are read from the configs a real ``summary.json`` holds. The figures are
drawn from summaries with those configs and made-up measurements, and checked for what a reader
needs: runs named by their labels, every legend outside every axes, a unit on every axis, phase
names spelled out.
"""

from __future__ import annotations

import copy

import pytest

from tests.experiment_helpers import composed_summary, composed_sweep, legends_over_data
from zeropp.experiments.projection.labels import RunLabels, label_runs, method_words
from zeropp.experiments.studies.report import phase_rows
from zeropp.experiments.studies.report_plots import PLOTS, byte_unit, figures

TINY = ["model=tiny", "logger=none"]


def _labels(*axes: list[str]) -> tuple[list[str], str]:
    r = label_runs(composed_sweep(*axes, *([t] for t in TINY)))
    return list(r.labels), r.common


def test_stage_by_offload_sweep() -> None:
    labels, common = _labels(["stage=1", "stage=3"], ["zero.offload_optimizer=none", "zero.offload_optimizer=cpu"])
    assert labels == ["ZeRO-1", "ZeRO-1 + CPU offload", "ZeRO-3", "ZeRO-3 + CPU offload"]
    assert common == "fp32, tiny model, 2x2 ranks"


def test_zeropp_ablation_and_recipes_with_extras() -> None:
    labels, common = _labels(
        ["stage=3"], [f"quant={q}" for q in ("none", "qwz", "hpz", "qgz", "zeropp", "w4g4h", "sdp4bit")]
    )
    assert labels == [
        "ZeRO-3",
        "ZeRO++ (qwZ INT8)",
        "ZeRO++ (hpZ)",
        "ZeRO++ (qgZ INT4)",
        "ZeRO++ (w8g4, hpZ)",
        "ZeRO++ (qwZ INT4, qgZ INT4+had)",
        "ZeRO++ (qwZ INT4, qgZ INT4+ef+had, hpZ, qWD INT4)",
    ]
    assert common == "fp32, tiny model, 2x2 ranks"


def test_trainers_sweep_names_each_trainer() -> None:
    labels, _ = _labels([f"+trainer_job={t}" for t in ("zeropp", "fsdp2_zeropp", "ddp_zeropp", "fsdp2", "ddp")])
    assert labels == ["ZeRO++ (w8g4)", "FSDP2 + ZeRO++ (w8g4)", "DDP + ZeRO++ (qgZ INT4)", "FSDP2", "DDP"]


def test_one_run_is_named_by_its_method_and_the_rest_is_common() -> None:
    r = label_runs([composed_summary(["stage=2", "zero.precision=bf16", "topology=1x2", *TINY])])
    assert r == RunLabels(labels=("ZeRO-2",), common="ZeRO-2, bf16, tiny model, 1x2 ranks")


def test_only_the_facets_that_differ_are_named() -> None:
    labels, common = _labels(["stage=3"], ["zero.precision=fp32", "zero.precision=bf16"])
    assert (labels, common) == (["fp32", "bf16"], "ZeRO-3, tiny model, 2x2 ranks")
    r = label_runs(
        composed_sweep(["stage=3"], ["model=tiny", "model=mini"], ["topology=1x2", "topology=2x2"], ["logger=none"])
    )
    assert r.labels == (
        "tiny model, 1x2 ranks",
        "tiny model, 2x2 ranks",
        "mini model, 1x2 ranks",
        "mini model, 2x2 ranks",
    )
    assert r.common == "ZeRO-3, fp32"


def test_a_key_without_a_word_falls_back_to_key_value() -> None:
    labels, common = _labels(["train.seed=0", "train.seed=1"])
    assert labels == ["train.seed=0", "train.seed=1"] and common.startswith("ZeRO-3, fp32")
    labels, _ = _labels(["stage=1", "stage=3"], ["zero.grad_accum_steps=1", "zero.grad_accum_steps=2"])
    assert labels == [
        "ZeRO-1, zero.grad_accum_steps=1",
        "ZeRO-1, zero.grad_accum_steps=2",
        "ZeRO-3, zero.grad_accum_steps=1",
        "ZeRO-3, zero.grad_accum_steps=2",
    ]
    # train.steps also moves optim.warmup_steps (a tenth of the run): the key typed names the runs
    labels, _ = _labels(["train.steps=10", "train.steps=30"])
    assert labels == ["train.steps=10", "train.steps=30"]
    # a setting the words do not cover, under a facet that does not tell the runs apart
    labels, _ = _labels(["quant=hpz"], ["zero.hpz_size=1", "zero.hpz_size=2"])
    assert labels == ["zero.hpz_size=1", "zero.hpz_size=2"]


def test_duplicate_runs_get_numbers_and_settings_that_measure_nothing_are_not_named() -> None:
    a = composed_summary(["stage=3", *TINY])
    b = copy.deepcopy(a)
    b["config"]["launcher"]["progress"] = False  # the progress bar: not a difference worth a label
    b["overrides"].append("launcher.progress=false")
    assert label_runs([a, b, a]).labels == ("ZeRO-3 #1", "ZeRO-3 #2", "ZeRO-3 #3")
    c = composed_summary(["stage=1", *TINY])
    assert label_runs([a, c, a]).labels == ("ZeRO-3 #1", "ZeRO-1", "ZeRO-3 #2")


@pytest.mark.parametrize(
    "trainer, zero, words",
    [
        ("zeropp", {"stage": 0}, "stage 0 (replicated)"),
        ("zeropp", {"stage": 2, "grads": {"bits": 4}}, "ZeRO-2 + qgZ INT4"),
        (
            "zeropp",
            {"stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme"},
            "ZeRO-3 + NVMe offload (optimizer + params)",
        ),
        (
            "zeropp",
            {"stage": 3, "offload_optimizer": "nvme", "offload_param": "cpu"},
            "ZeRO-3 + NVMe optimizer + CPU param offload",
        ),
        ("zeropp", {"stage": 3, "offload_param": "cpu"}, "ZeRO-3 + CPU param offload"),
        (
            "zeropp",
            {"stage": 3, "weights": {"bits": 8, "group_size": 64}, "grads": {"bits": 4, "rounding": "stochastic"}},
            "ZeRO++ (qwZ INT8g64, qgZ INT4+sr)",
        ),
        (
            "zeropp",
            {"stage": 3, "weights": {"bits": 8}, "grads": {"bits": 4}, "offload_optimizer": "cpu"},
            "ZeRO++ (w8g4) + CPU offload",
        ),
        ("zeropp", {"stage": 3, "weights": {"bits": 8, "no_such_field": 1}}, "ZeRO++ (qwZ custom)"),
        (
            "zeropp",
            {"stage": 3, "weights": {"scheme": "mx", "bits": 8}, "grads": {"scheme": "mx", "bits": 4, "intra_bits": 8}},
            "ZeRO++ (qwZ MXFP8, qgZ MXFP8/4)",
        ),
        ("fsdp2", {"hpz": True}, "FSDP2 (hpZ)"),
        ("megatron", {}, "trainer=megatron"),
    ],
)
def test_method_words(trainer: str, zero: dict, words: str) -> None:
    assert method_words(trainer, zero) == words


def test_labels_are_unique_by_construction() -> None:
    with pytest.raises(ValueError, match="unique"):
        RunLabels(labels=("ZeRO-3", "ZeRO-3"), common="")


# ---------------------------------------------------------------------- the figures
def _snapshot(device: int, host: int = 0) -> dict:
    return {
        "tiers": {"device": {"params": device}, "host": {"params": host}, "disk": {}},
        "tier_totals": {"device": device, "host": host, "disk": 0},
        "peak": device,
    }


def _measured(summary: dict, i: int) -> dict:
    """``summary`` with made-up measurements where the figures read them (run ``i`` of a sweep)."""
    phases = ["model_creation", "optimizer_creation", "forward", "backward", "step"]
    return {
        **summary,
        "tokens_per_s": 1000.0 * (i + 1),
        "comm_bytes_per_step": {"by_link": {"intra": 3 * 2**20 * (i + 1), "cross": 2**20}},
        "memory_per_rank": [{"params": 2**20, "grads": 2**20, "optimizer": 2**21, "total": 2**22}] * 2,
        "memory_by_phase": [{p: _snapshot(2**20 * (k + 1), 2**19 * i) for k, p in enumerate(phases)}] * 2,
        "loss": {"curve": [5.0, 4.0 - 0.1 * i, 3.5]},
        "_metrics": [],
    }


def test_figures_name_runs_by_label_keep_legends_off_the_data_and_give_units() -> None:
    import matplotlib.pyplot as plt

    sweep = composed_sweep(
        ["stage=3"],
        ["zero.offload_optimizer=none", "zero.offload_optimizer=cpu"],
        ["quant=none", "quant=w8g4"],
        TINY[:1],
        TINY[1:],
    )
    runs = [_measured(s, i) for i, s in enumerate(sweep)]
    names = label_runs(runs)
    assert names.labels == ("ZeRO-3", "ZeRO++ (w8g4)", "ZeRO-3 + CPU offload", "ZeRO++ (w8g4) + CPU offload")
    figs = figures(runs, names.labels, names.common, phase_rows)
    try:
        assert list(figs) == list(PLOTS)
        for name, fig in figs.items():
            assert fig.legends or name == "throughput.png", name  # one series needs no legend
            assert legends_over_data(fig) == [], name
            text = " ".join(t.get_text() for t in fig.texts) + fig._suptitle.get_text()
            assert names.common in text or any(names.common in ax.get_title(loc="left") for ax in fig.axes), name
            for ax in fig.axes:
                if not ax.get_visible():
                    continue
                if name in ("throughput.png", "comm_bytes.png", "memory.png"):
                    assert [t.get_text() for t in ax.get_yticklabels()] == list(names.labels), name
                    assert any(u in ax.get_xlabel() for u in ("tokens per second", "MiB")), (name, ax.get_xlabel())
                elif name == "memory_phases.png":
                    assert ax.get_title() in names.labels
                    assert [t.get_text() for t in ax.get_xticklabels()] == [
                        "model\ncreation",
                        "optimizer\ncreation",
                        "forward",
                        "backward",
                        "step",
                    ]
                    assert ax.get_ylabel() in ("", "MiB per rank")
                else:
                    assert ax.get_xlabel() == "step" and "nats per token" in ax.get_ylabel()
                    assert [ln.get_label() for ln in ax.get_lines()] == list(names.labels)
        assert [ax.get_ylabel() for ax in figs["memory_phases.png"].axes][::4] == ["MiB per rank"]
    finally:
        for fig in figs.values():
            plt.close(fig)


def test_byte_unit_reads_in_ones_to_thousands() -> None:
    assert byte_unit(0) == (1.0, "B") and byte_unit(1023) == (1.0, "B")
    assert byte_unit(1024) == (1024.0, "KiB") and byte_unit(5 * 2**20) == (2.0**20, "MiB")
    assert byte_unit(3 * 2**30) == (2.0**30, "GiB")


def test_a_folder_of_sweeps_is_read_sweep_by_sweep_in_job_order(tmp_path) -> None:
    import json

    from zeropp.experiments.studies.report import load_runs

    dirs = [tmp_path / "1-offload" / str(j) for j in (0, 1, 2, 10)] + [
        tmp_path / "2-zeropp" / "0",
        tmp_path / "3-fsdp2",
    ]
    for d in reversed(dirs):  # created out of order: the order comes from the paths, not the disk
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({"label": str(d.relative_to(tmp_path))}))
    assert [s["label"] for s in load_runs(tmp_path)] == [str(d.relative_to(tmp_path)) for d in dirs]
