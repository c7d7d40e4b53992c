"""A run's checkpoint out as a Hugging Face ``save_pretrained`` directory (``zeropp.models.hf_export``,
``python -m experiments.export``).

Here: the one-process checks. Checkpoints are written as the runner writes them (ZeroEngine in a
world of one, the model settings in ``extra["model"]``), exported, and loaded back with
``transformers`` (and ``peft``); the logits are compared with our own model holding the trained
weights. The runner's 2x2 stage-3 runs exported end to end are ``tests/e2e/test_hf_export.py``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.hf_export_helpers import (
    hf_logits,
    load_pretrained,
    model_record,
    our_logits,
    tokens,
    train_and_save,
    train_and_save_ddp,
    world_of_one,
)
from zeropp.models import GPT, GPTConfig, HFConfig
from zeropp.output_files import OutputWriteError

REASON = 'Hugging Face models need the optional extra: pip install -e ".[hf]"'
GPT2 = HFConfig(hf_config="gpt2", d_model=32, n_layers=2, n_heads=2, seq_len=16, vocab_size=64)
LLAMA = HFConfig(
    hf_config="llama", d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=16, vocab_size=64, tie_embeddings=True
)
CASES: dict[str, tuple[HFConfig, int]] = {  # name -> (model, stage)
    "gpt2": (GPT2, 3),
    "llama": (LLAMA, 3),
    "gpt2-lora": (GPT2.with_(lora_rank=2), 3),
    "llama-lora": (LLAMA.with_(lora_rank=2, tie_embeddings=False), 1),
    "llama-tied-lora": (LLAMA.with_(lora_rank=2), 3),  # a frozen tied weight: saved under one of its names
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One checkpoint per case (and of the built-in GPT), with the trained weights as references."""
    pytest.importorskip("transformers", reason=REASON)
    from zeropp.models import build_hf_model

    root = tmp_path_factory.mktemp("hf_export")
    out: dict[str, Any] = {}
    with world_of_one(root / "store"):
        for name, (cfg, stage) in CASES.items():
            out[name] = train_and_save(build_hf_model(cfg, seed=0), cfg, root / name, stage=stage)
        out["gpt2-ddp"] = train_and_save_ddp(build_hf_model(GPT2, seed=0), GPT2, root / "gpt2-ddp")
        gpt = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=1, n_heads=2)
        torch.manual_seed(0)
        train_and_save(GPT(gpt), gpt, root / "gpt", stage=3)
    out["root"] = root
    return out


def _export(ckpts: dict[str, Any], name: str, out: Path, **kw: Any) -> Path:
    from zeropp.models.hf_export import export_pretrained

    return export_pretrained(ckpts["root"] / name, out, **kw)


@pytest.mark.parametrize("name", ["gpt2", "llama", "gpt2-ddp"])
def test_export_loads_in_transformers_with_the_trained_logits(ckpts: dict[str, Any], tmp_path: Path, name: str) -> None:
    cfg = CASES[name][0] if name in CASES else GPT2  # gpt2-ddp: trainer=ddp's checkpoint format
    out = _export(ckpts, name, tmp_path / "out")
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors"} <= files and not any(f.endswith((".bin", ".pt")) for f in files)
    model = load_pretrained(out)
    assert type(model).__name__ == {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[cfg.hf_config]
    idx, _ = tokens(cfg, seed=7)
    assert torch.equal(hf_logits(model, idx), our_logits(cfg, ckpts[name], idx))  # exact in fp32
    if cfg.tie_embeddings:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert not list(tmp_path.glob(".*export-tmp*"))  # the temporary directory was renamed into place


@pytest.mark.parametrize("name", ["gpt2-lora", "llama-lora", "llama-tied-lora"])
def test_lora_merged_gives_the_adapted_logits(ckpts: dict[str, Any], tmp_path: Path, name: str) -> None:
    cfg = CASES[name][0]
    idx, _ = tokens(cfg, seed=7)
    merged = load_pretrained(_export(ckpts, name, tmp_path / "merged"))
    assert not any("lora" in k for k in merged.state_dict())
    want = our_logits(cfg, ckpts[name], idx)  # the adapted model, adapters unmerged
    got = hf_logits(merged, idx)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # merging rounds once per weight
    # the adapters moved the model: the base weights alone give other logits
    base = {k: torch.zeros_like(v) if k.endswith("lora_b") else v for k, v in ckpts[name].items()}
    assert (our_logits(cfg, base, idx) - want).abs().max() > 1e-3


def test_lora_as_a_peft_adapter_loads_and_merges_as_ours(ckpts: dict[str, Any], tmp_path: Path) -> None:
    peft = pytest.importorskip("peft", reason='the peft export needs peft: pip install -e ".[hf]"')
    from zeropp.models.hf_export import ADAPTER_DIR

    name = "gpt2-lora"  # GPT-2's Conv1D: the transposed case (fan_in_fan_out)
    cfg = CASES[name][0]
    idx, _ = tokens(cfg, seed=7)
    out = _export(ckpts, name, tmp_path / "peft", lora_format="peft")
    assert (out / ADAPTER_DIR / "adapter_config.json").is_file()
    base = load_pretrained(out)  # the directory itself is the base model, adapters unmerged
    adapted = peft.PeftModel.from_pretrained(base, out / ADAPTER_DIR).eval()
    torch.testing.assert_close(hf_logits(adapted, idx), our_logits(cfg, ckpts[name], idx), rtol=1e-6, atol=1e-6)
    # peft's own merge is the reference for ours
    peft_merged = adapted.merge_and_unload().state_dict()
    ours = load_pretrained(_export(ckpts, name, tmp_path / "merged")).state_dict()
    assert peft_merged.keys() == ours.keys()
    for k in ours:
        torch.testing.assert_close(ours[k], peft_merged[k], rtol=1e-6, atol=1e-7)


def test_refuses_a_non_empty_out_dir_and_touches_nothing(ckpts: dict[str, Any], tmp_path: Path) -> None:
    from zeropp.models.hf_export import ExportError

    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="exists and is not empty.*never overwrites"):
        _export(ckpts, "gpt2", out)
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    (tmp_path / "file").write_text("x")
    with pytest.raises(ExportError, match="is not a directory"):
        _export(ckpts, "gpt2", tmp_path / "file")
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "link").symlink_to(empty)  # the rename at the end would replace the link, not fill its target
    with pytest.raises(ExportError, match=r"link is a symlink \(to .*empty\); the export writes a new directory"):
        _export(ckpts, "gpt2", tmp_path / "link")
    assert (_export(ckpts, "gpt2", empty) / "model.safetensors").is_file()  # an empty directory is fine


def test_refuses_a_place_it_cannot_create_the_out_dir_before_reading(tmp_path: Path, monkeypatch) -> None:
    """Before: the checkpoint was read, then a FileNotFoundError / NotADirectoryError traceback
    (``python -m experiments.export RUN /proc/x``). Refused before the checkpoint is looked for."""
    from zeropp.models import hf_export

    monkeypatch.setattr(hf_export, "find_checkpoint", lambda src: pytest.fail("the checkpoint was read"))
    (tmp_path / "file").write_text("x")
    for out, words in [
        (Path("/proc/export"), "/proc/export cannot be created: /proc does not let this process create files"),
        (tmp_path / "file" / "sub" / "deeper", f"cannot be created: {tmp_path / 'file'} is not a directory"),
    ]:
        with pytest.raises(hf_export.ExportError, match=words):
            hf_export.export_pretrained(tmp_path / "run", out)
    assert (tmp_path / "file").read_text() == "x"


def test_refuses_a_checkpoint_of_the_built_in_gpt(ckpts: dict[str, Any], tmp_path: Path) -> None:
    from zeropp.models.hf_export import ExportError

    with pytest.raises(ExportError, match="model.kind=gpt .*only runs with model=hf"):
        _export(ckpts, "gpt", tmp_path / "out")
    from zeropp.models.hf_export import export_pretrained

    src = _without_record(ckpts["root"] / "gpt", tmp_path / "old")  # HF settings given by hand, wrongly
    with pytest.raises(ExportError, match="not of a Hugging Face model.*outside hf"):
        export_pretrained(src, tmp_path / "out", model_config=GPT2)
    assert not (tmp_path / "out").exists()


def test_a_run_from_a_pretrained_directory_exports_without_it(tmp_path: Path) -> None:
    """The export rebuilds the model from the transformers config the checkpoint recorded, not from
    model.pretrained's directory: once that is gone the export still works, and when it now holds
    another model (another norm epsilon and rotary base) the export is still the trained one
    (before: 'HFConfig.pretrained=... does not exist', or logits of the other settings)."""
    pytest.importorskip("transformers", reason=REASON)
    from zeropp.models import build_hf_model
    from zeropp.models.hf import hf_model_config
    from zeropp.models.hf_export import export_pretrained

    base = LLAMA.with_(tie_embeddings=False)
    conf = hf_model_config(base)
    conf.rms_norm_eps, conf.rope_parameters = 1e-2, {"rope_type": "default", "rope_theta": 500.0}
    pre = tmp_path / "pre"
    type(build_hf_model(base).hf)(conf).save_pretrained(pre)
    cfg = base.with_(pretrained=str(pre), lora_rank=2)
    with world_of_one(tmp_path / "store"):
        trained = train_and_save(build_hf_model(cfg, seed=0), cfg, tmp_path / "run", stage=3)
    idx, _ = tokens(cfg, seed=7)
    want = our_logits(cfg, trained, idx)
    conf.rms_norm_eps = 0.5  # the directory now holds another model of the same sizes
    type(build_hf_model(base).hf)(conf).save_pretrained(pre)
    out = export_pretrained(tmp_path / "run", tmp_path / "a")
    torch.testing.assert_close(hf_logits(load_pretrained(out), idx), want, rtol=1e-5, atol=1e-5)
    shutil.rmtree(pre)
    out = export_pretrained(tmp_path / "run", tmp_path / "b", lora_format="peft")
    assert json.loads((out / "config.json").read_text())["rms_norm_eps"] == 1e-2


def _without_record(src: Path, dst: Path, keys: tuple[str, ...] = ("model",)) -> Path:
    """A copy of checkpoint ``src`` whose meta.json has no model settings (as saved before they were
    recorded; meta.json is not among the checksummed files), nor the other ``keys`` of its extra."""
    shutil.copytree(src, dst)
    d = dst / (dst / "LATEST").read_text().strip()
    meta = json.loads((d / "meta.json").read_text())
    for k in keys:
        meta["extra"].pop(k, None)
    (d / "meta.json").write_text(json.dumps(meta))
    return dst


def test_a_checkpoint_without_model_settings(ckpts: dict[str, Any], tmp_path: Path) -> None:
    from zeropp.models.hf_export import MissingModelConfig, export_pretrained

    src = _without_record(ckpts["root"] / "llama", tmp_path / "old")
    with pytest.raises(MissingModelConfig, match="records no model settings.*model_config=HFConfig"):
        export_pretrained(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    out = export_pretrained(src, tmp_path / "out", model_config=LLAMA)
    idx, _ = tokens(LLAMA, seed=3)
    assert torch.equal(hf_logits(load_pretrained(out), idx), our_logits(LLAMA, ckpts["llama"], idx))


def test_refuses_settings_that_do_not_match_the_checkpoint(ckpts: dict[str, Any], tmp_path: Path) -> None:
    from zeropp.models.hf_export import ExportError, export_pretrained

    with pytest.raises(ExportError, match="differs from the model settings recorded"):
        _export(ckpts, "gpt2", tmp_path / "a", model_config=GPT2.with_(n_layers=1))
    src = _without_record(ckpts["root"] / "gpt2", tmp_path / "old")
    with pytest.raises(ExportError, match="recorded transformers config has n_layers=2, which these settings do not"):
        export_pretrained(src, tmp_path / "b", model_config=GPT2.with_(n_layers=1))
    older = _without_record(ckpts["root"] / "gpt2", tmp_path / "older", ("model", "transformers_config"))
    with pytest.raises(ExportError, match="does not match the gpt2 model.*unexpected \\['transformer.h.1"):
        export_pretrained(older, tmp_path / "b", model_config=GPT2.with_(n_layers=1))
    with pytest.raises(ExportError, match="lora_format=peft needs a LoRA run"):
        _export(ckpts, "gpt2", tmp_path / "c", lora_format="peft")
    with pytest.raises(ExportError, match="no LATEST"):
        export_pretrained(tmp_path, tmp_path / "d")
    assert not any((tmp_path / n).exists() for n in "abcd")


def test_a_failed_write_leaves_no_out_dir(
    ckpts: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure after the weights were written (here: the peft adapter's save) removes the
    temporary directory; ``out_dir`` never appears half written."""
    from zeropp.models import hf_export

    def broken(*a: Any, **k: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf_export, "_save_peft", broken)
    with pytest.raises(OutputWriteError) as e:
        _export(ckpts, "gpt2-lora", tmp_path / "out", lora_format="peft")
    assert list(tmp_path.iterdir()) == []
    assert str(e.value).startswith(f"cannot write the export to {tmp_path / 'out'}: No space left on device")


def test_the_command_line_reports_a_full_disk_in_one_line(
    ckpts: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: transformers' OSError traceback from inside save_pretrained, exit 1."""
    from zeropp.experiments.export import main
    from zeropp.models import hf_export

    def full(*a: Any, **k: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf_export, "copy_tokenizer", full)  # after save_pretrained wrote the weights
    with pytest.raises(SystemExit) as e:
        main([str(ckpts["root"] / "gpt2"), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert e.value.code == 1 and "\nerror: cannot write the export to " in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_command_line_exports_a_run_dir_and_reports_errors(
    ckpts: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from zeropp.experiments.export import main

    run = tmp_path / "run"  # a run directory: checkpoints/ and summary.json, the checkpoint without settings
    _without_record(ckpts["root"] / "gpt2", run / "checkpoints")
    (run / "summary.json").write_text(json.dumps({"config": {"model": model_record(GPT2)}}))
    main([str(run), str(tmp_path / "out")])
    assert "wrote" in capsys.readouterr().out
    idx, _ = tokens(GPT2, seed=5)
    assert torch.equal(hf_logits(load_pretrained(tmp_path / "out"), idx), our_logits(GPT2, ckpts["gpt2"], idx))
    capsys.readouterr()  # the load's progress bar
    with pytest.raises(SystemExit) as e:
        main([str(run), str(tmp_path / "out")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "exists and is not empty" in err
    (run / "summary.json").unlink()
    with pytest.raises(SystemExit) as e:
        main([str(run), str(tmp_path / "out2")])
    assert e.value.code == 2 and "records no model settings" in capsys.readouterr().err
    settings = tmp_path / "settings.json"  # --model-config: a JSON object of model.* settings
    settings.write_text(json.dumps(model_record(GPT2)))
    main([str(run / "checkpoints"), str(tmp_path / "out2"), "--model-config", str(settings)])
    assert (tmp_path / "out2" / "model.safetensors").is_file()
    os.mkfifo(tmp_path / "fifo")  # a settings file named by mistake: refused at once, not read (or waited on)
    for bad, words in [
        ("fifo", "is a FIFO (named pipe), not a regular file"),
        ("", "is a directory, not a regular file"),
    ]:
        with pytest.raises(SystemExit) as e:
            main([str(run / "checkpoints"), str(tmp_path / "out3"), "--model-config", str(tmp_path / bad)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"--model-config {tmp_path / bad} cannot be read: {words}" in err, err


def test_refuses_a_corrupt_or_crafted_checkpoint(ckpts: dict[str, Any], tmp_path: Path) -> None:
    from tests.checkpoint_helpers import plant_metadata
    from zeropp.models.hf_export import ExportError, export_pretrained

    src = tmp_path / "ckpt"
    shutil.copytree(ckpts["root"] / "gpt2", src)
    d = src / (src / "LATEST").read_text().strip()
    data = next(d.glob("*.distcp"))
    good = data.read_bytes()
    raw = bytearray(good)
    raw[100:104] = b"XXXX"  # a flipped region: what a bad disk or a truncated copy gives
    data.write_bytes(bytes(raw))
    with pytest.raises(ExportError, match="cannot read the checkpoint.*fails its checksum"):
        export_pretrained(src, tmp_path / "a")
    data.write_bytes(good)
    marker = tmp_path / "pwned"
    plant_metadata(d, marker)  # a .metadata pickle that runs a command when unpickled, checksum recomputed
    with pytest.raises(ExportError, match="cannot read the checkpoint.*metadata"):
        export_pretrained(src, tmp_path / "b")
    assert not marker.exists() and not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_command_line_says_when_the_checkpoint_is_not_the_runs_end(
    ckpts: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The export names the step it exported, and warns when that is not where the run ended: a
    diverged run (its last good checkpoint) or one stopped before train.steps (before: 'wrote out'
    alone, whichever step it was)."""
    from zeropp.experiments.export import main

    run = tmp_path / "run"
    shutil.copytree(ckpts["root"] / "gpt2", run / "checkpoints")
    d = run / "checkpoints" / (run / "checkpoints" / "LATEST").read_text().strip()
    meta = json.loads((d / "meta.json").read_text())
    meta["extra"]["run"] = {"train.steps": 8}  # as the runner records it
    (d / "meta.json").write_text(json.dumps(meta))
    main([str(run), str(tmp_path / "a")])
    out, err = capsys.readouterr()
    assert "from the checkpoint of step 1 " in out
    assert "warning: the run was to train 8 steps (train.steps) and this checkpoint is of step 1" in err, err
    (run / "summary.json").write_text(json.dumps({"status": "diverged", "divergence": {"step": 2}}))
    main([str(run), str(tmp_path / "b")])
    assert "warning: the run diverged at step 2; this is its last good checkpoint, of step 1" in capsys.readouterr().err
    meta["extra"]["run"] = {"train.steps": 1}
    (d / "meta.json").write_text(json.dumps(meta))
    (run / "summary.json").write_text(json.dumps({"status": "completed"}))
    main([str(run), str(tmp_path / "c")])
    assert "warning" not in capsys.readouterr().err


def test_peft_missing_is_refused_before_the_checkpoint_is_read(
    ckpts: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--lora-format peft`` without peft installed stops at once (before: after the whole
    checkpoint was read and the base model written to the temporary directory)."""
    import sys

    from zeropp.models.hf_export import ExportError
    from zeropp.runtime import consolidate

    def unread(*a: Any, **k: Any) -> None:
        raise AssertionError("the checkpoint was read")

    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` now raises ImportError
    monkeypatch.setattr(consolidate, "read_consolidated", unread)
    with pytest.raises(ExportError, match=r"lora_format=peft needs the peft package: pip install peft"):
        _export(ckpts, "gpt2-lora", tmp_path / "out", lora_format="peft")
    assert not list(tmp_path.iterdir())
