"""The runner with Hugging Face models: ``model=hf model.hf_config=gpt2|llama`` (plus size keys)
composes at every stage and quant preset, each model key is declared once (in ``HFConfig``), keys
of the other model kind are refused by name, and real runs from the command line train GPT-2 and
Llama (Llama from a local pretrained directory). Without the ``hf`` extra the runs skip with that
reason, and the runner's own refusal is tested by hiding ``transformers``.

Here: the one-process checks of this topic; its other tiers' checks are in
``tests/e2e/test_experiments_hf.py``.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from tests.experiment_helpers import composed_config
from zeropp.comm.spec import RECIPES
from zeropp.experiments.runner.config import MODEL_KINDS, ConfigError, from_dict, from_omegaconf
from zeropp.experiments.runner.overrides import check_overrides, group_options
from zeropp.experiments.runner.schema import model_schema
from zeropp.models import GPTConfig, HFConfig

REASON = 'Hugging Face models need the optional extra: pip install -e ".[hf]"'
TINY = ["model.d_model=32", "model.seq_len=32", "model.n_layers=2"]
# two ranks, not four: each rank imports transformers (seconds of CPU); the 2x2 parity is tests/distributed/test_models_hf.py


def test_model_hf_is_an_option_and_its_keys_come_from_hfconfig() -> None:
    assert "hf" in group_options("model")
    fields = {f.name for f in dataclasses.fields(model_schema())}
    for cls in MODEL_KINDS.values():  # every field of every kind is a key, declared once in the library
        assert {f.name for f in dataclasses.fields(cls)} <= fields
    assert from_dict(composed_config("model=hf")).model == HFConfig()
    rc = from_dict(
        composed_config("model=hf", "model.hf_config=llama", "model.n_kv_heads=1", *TINY, "model.intermediate_size=40")
    )
    assert rc.model == HFConfig(hf_config="llama", n_kv_heads=1, d_model=32, seq_len=32, intermediate_size=40)
    assert from_dict(rc.to_dict()) == rc  # what the ranks rebuild from the spec
    assert "hf-llama d32xL2" in rc.describe()
    assert from_dict(composed_config("model=mini")).model == GPTConfig.preset("mini")
    check_overrides(["model=hf", "model.hf_config=llama", "model.n_kv_heads=2", "model.pretrained=/x"])


def test_every_stage_and_quant_preset_composes() -> None:
    """Every quant preset at stage 3 (qwZ and hpZ are stage-3 features), stages 0-2 unquantized
    and stages 1-2 with qgZ (stage 0 all-reduces), alternating GPT-2 and Llama (composing costs ~0.2 s each)."""
    combos = [(q, 3) for q in RECIPES] + [("none", 0)] + [(q, s) for s in (1, 2) for q in ("none", "qgz")]
    for k, (quant, stage) in enumerate(combos):
        arch = ("gpt2", "llama")[k % 2]
        rc = from_dict(composed_config("model=hf", f"model.hf_config={arch}", f"quant={quant}", f"stage={stage}"))
        assert isinstance(rc.model, HFConfig) and rc.model.hf_config == arch and rc.zero.stage == stage
        assert (rc.zero.weights, rc.zero.grads, rc.zero.hpz) == (
            RECIPES[quant].weights,
            RECIPES[quant].grads,
            RECIPES[quant].hpz,
        )


@pytest.mark.parametrize(
    "args, words",
    [
        (["model=hf", "model.mlp_ratio=2"], "model.mlp_ratio=2 does nothing with model.kind=hf"),
        (["model=mini", "model.hf_config=llama"], "model.hf_config='llama' does nothing with model.kind=gpt"),
        (["model.n_kv_heads=2"], "model.n_kv_heads=2 does nothing with model.kind=gpt"),
        (["model=hf", "model.n_kv_heads=2"], "model.n_kv_heads=2 applies to hf_config=llama only"),
        (["model=hf", "model.hf_config=bert"], "model.hf_config='bert' is not supported"),
        (["model=hf", "model.n_heads=3"], "n_heads=3 must divide d_model=64"),
        (["model=hf", "model.pretrained=/no/such/dir"], "model.pretrained='/no/such/dir' does not exist"),
        (["model.kind=bert"], "model.kind='bert'; allowed: gpt, hf"),
    ],
)
def test_bad_model_settings_name_the_key(args: list[str], words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        from_dict(composed_config(*args))


def test_runner_refuses_model_hf_without_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from hydra import compose, initialize_config_module

    import zeropp.experiments.runner.run  # noqa: F401 - registers the generated schema and groups

    with initialize_config_module(config_module="zeropp.conf", version_base="1.3"):
        cfg = compose("config", overrides=["model=hf"])
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    with pytest.raises(ConfigError, match=r'model=hf needs the Hugging Face extra.*pip install -e "\.\[hf\]"'):
        from_omegaconf(cfg)
    from_dict(composed_config("model=hf"))  # composing and validating need no transformers


def test_runner_refuses_model_hf_with_a_broken_transformers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A transformers that is found but fails to import: one config error before any rank starts."""
    broken = tmp_path / "transformers"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise ImportError('cannot import name x from half_upgraded')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "transformers" or m.startswith("transformers.")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ConfigError, match=r"model=hf cannot import transformers \(ImportError: cannot import name x"):
        from_dict(composed_config("model=hf")).check_installed()


@pytest.mark.parametrize("trainer", ["zeropp", "fsdp2", "ddp"])
def test_trainers_build_the_hf_model(trainer: str) -> None:
    pytest.importorskip("transformers", reason=REASON)
    from zeropp.experiments.runner.trainers import build_model
    from zeropp.models import build_hf_model

    rc = from_dict(composed_config("model=hf", "model.hf_config=llama", *TINY, f"trainer={trainer}", "train.seed=5"))
    model = build_model(rc, torch.device("cpu"))
    ref = build_hf_model(rc.model, seed=5)
    assert type(model) is type(ref) and len(model.blocks) == 2
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))  # seeded like every rank


def test_runner_refuses_incomplete_pretrained_weights_before_any_rank(tmp_path: Path) -> None:
    """A weight missing from model.pretrained is refused while the config is read (before: every
    rank started and trained with that weight drawn at random)."""
    pytest.importorskip("transformers", reason=REASON)
    from hydra import compose, initialize_config_module
    from safetensors.torch import load_file, save_file

    import zeropp.experiments.runner.run  # noqa: F401 - registers the generated schema and groups
    from zeropp.models import build_hf_model

    build_hf_model(HFConfig(d_model=32, n_layers=1), seed=0).hf.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["transformer.h.0.mlp.c_fc.weight"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    args = ["model=hf", "model.d_model=32", "model.n_layers=1", f"model.pretrained={tmp_path}"]
    with initialize_config_module(config_module="zeropp.conf", version_base="1.3"):
        cfg = compose("config", overrides=args)
    with pytest.raises(ConfigError, match=r"invalid config model: model.pretrained=.*missing \['transformer.h.0.mlp"):
        from_omegaconf(cfg)


def test_a_broken_transformers_install_is_one_error_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """transformers found but failing to import (a broken or mismatched install): with
    model.pretrained the weights check needs it, and says so in one ConfigError (before: an
    ImportError traceback from the runner)."""
    pytest.importorskip("transformers", reason=REASON)
    import importlib.util

    from hydra import compose, initialize_config_module

    import zeropp.experiments.runner.run  # noqa: F401 - registers the generated schema and groups
    from zeropp.models import build_hf_model

    build_hf_model(HFConfig(d_model=32, n_layers=1), seed=0).hf.save_pretrained(tmp_path)
    args = ["model=hf", "model.d_model=32", "model.n_layers=1", f"model.pretrained={tmp_path}"]
    with initialize_config_module(config_module="zeropp.conf", version_base="1.3"):
        cfg = compose("config", overrides=args)
    found = importlib.util.find_spec("transformers")
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: found if name == "transformers" else None)
    with pytest.raises(ConfigError, match=r"model=hf cannot import transformers.*pip install"):
        from_omegaconf(cfg)


def test_the_pre_launch_size_checks_build_a_pretrained_model_as_shapes(tmp_path: Path) -> None:
    """The runner's memory checks count parameters on a model built on the meta device; for
    ``model.pretrained`` that is the directory's config without its weights (before:
    ``from_pretrained`` under the meta device raised, a traceback for a valid stage-3 config with
    a persistence threshold)."""
    pytest.importorskip("transformers", reason=REASON)
    from zeropp.experiments.runner.preflight import persistent_params
    from zeropp.models import build_hf_model

    build_hf_model(HFConfig(d_model=32, n_layers=1), seed=0).hf.save_pretrained(tmp_path)
    sizes = ["model=hf", "model.d_model=32", "model.n_layers=1", "stage=3", "zero.persistence_threshold=100"]
    rc = from_dict(composed_config(*sizes, f"model.pretrained={tmp_path}"))
    fresh = from_dict(composed_config(*sizes))
    assert persistent_params(rc) == persistent_params(fresh) and persistent_params(rc)[0] > 0  # biases, norms < 100


def test_a_checkpoint_records_model_pretrained_as_the_absolute_path_the_run_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relative ``model.pretrained`` is recorded against the run's working directory, so the export
    (``python -m experiments.export`` run elsewhere) reads that directory's tokenizer and config
    (before: recorded as given, then resolved against the export's working directory, where a
    same-named folder would have been read)."""
    pytest.importorskip("transformers", reason=REASON)
    from tests.toy_trainer import FakeTrainer
    from zeropp.experiments.runner.train_checkpoint import Checkpointer
    from zeropp.models import build_hf_model

    (tmp_path / "work").mkdir()
    build_hf_model(HFConfig(d_model=32, n_layers=1), seed=0).hf.save_pretrained(tmp_path / "work" / "pre")
    monkeypatch.chdir(tmp_path / "work")
    rc = from_dict(
        composed_config(
            "model=hf", "model.d_model=32", "model.n_layers=1", "model.pretrained=pre", "train.checkpoint_every=1"
        )
    )
    trainer = FakeTrainer()
    ckpt = Checkpointer(rc, tmp_path / "run", trainer, lead=True)
    assert ckpt.after_step(1, diverged=False)
    recorded = trainer.saves[0][1]["model"]
    assert recorded["pretrained"] == str(tmp_path / "work" / "pre")
    assert {**recorded, "pretrained": "pre"} == rc.to_dict()["model"]
