"""The trainer registry: one ``TrainerSpec`` per trainer, which the config, the Hydra groups and the
worker's builder all consult; a trainer registered from outside is a first-class ``trainer=``.

Here: the one-process checks. A registered toy trainer trained by the worker's loop is in
``tests/distributed/test_experiments_registry.py``.
"""

from __future__ import annotations

import dataclasses
import typing

import pytest

from tests.experiment_helpers import composed_config
from tests.toy_trainer import TOY_SPEC, ToyTrainer
from zeropp.experiments.runner.config import ConfigError, from_dict
from zeropp.experiments.runner.overrides import group_options
from zeropp.experiments.runner.schema import run_schema
from zeropp.experiments.runner.trainer_registry import TRAINER_SPECS, TrainerSpec, register_trainer, resolve_builder
from zeropp.experiments.runner.trainers import build_trainer

BUILT_IN = ("zeropp", "fsdp2", "fsdp2_zeropp", "ddp", "ddp_zeropp")
SMALL = {
    "model": {"n_layers": 1, "d_model": 16, "n_heads": 2, "vocab_size": 64, "seq_len": 8},
    "data": {"kind": "random"},
    "topology": {"nodes": 1, "ranks_per_node": 2},
}


def _cfg(**sections: dict) -> dict:
    return {**SMALL, **sections}


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> TrainerSpec:
    monkeypatch.setitem(TRAINER_SPECS, "toy", TOY_SPEC)
    return TOY_SPEC


def test_every_honoured_key_is_a_key_of_the_schema() -> None:
    """A spec cannot honour a key that does not exist: each is a ``zero.*`` field of the generated
    schema, or the top-level ``stage``."""
    schema = typing.get_type_hints(run_schema())
    zero_keys = {f.name for f in dataclasses.fields(schema["zero"])}
    assert "stage" in schema
    for spec in TRAINER_SPECS.values():
        for key in spec.honours or ():
            assert key == "stage" or key.removeprefix("zero.") in zero_keys, (spec.name, key)
        for key in spec.needs_any_of:
            assert key.removeprefix("zero.") in zero_keys and spec.honours_key(key), (spec.name, key)


def test_the_built_in_trainers_are_registered_and_their_builders_resolve() -> None:
    assert tuple(TRAINER_SPECS)[:5] == BUILT_IN
    for spec in TRAINER_SPECS.values():
        assert callable(resolve_builder(spec)), spec.name
    assert group_options("trainer") == list(TRAINER_SPECS)


@pytest.mark.parametrize("name", BUILT_IN)
def test_sweep_trainer_job_composes_the_trainer_with_its_recipe(name: str) -> None:
    """``+trainer_job=<name>`` (sweep=trainers) is generated from the spec: its trainer and quant."""
    rc = from_dict(composed_config(f"+trainer_job={name}"))
    want = from_dict(composed_config(f"trainer={name}", f"quant={TRAINER_SPECS[name].sweep_quant}"))
    assert rc.trainer.name == name and rc.zero == want.zero


@pytest.mark.parametrize(
    "trainer, override, words",
    [
        ("ddp", "zero.offload_optimizer=cpu", ["zero.offload_optimizer='cpu'", "trainer=ddp", "trainer=zeropp"]),
        # a recipe's spec by its label and how to drop it (before: QuantSpec(bits=8, group_size=None, ...), "Remove it")
        (
            "fsdp2",
            "quant=int8",
            ["zero.weights (int8) does nothing", "does not honour zero.weights", "zero.weights=null", "fsdp2_zeropp"],
        ),
        ("ddp_zeropp", "quant=nvfp4", ["zero.weights (nvfp4) does nothing with trainer=ddp_zeropp"]),
        ("ddp", "quant=qgz", ["zero.grads", "trainer=ddp_zeropp"]),
        ("fsdp2", "stage=2", ["stage=2", "FSDP2 is always ZeRO-3", "trainer=zeropp"]),
        ("ddp", "zero.precision=fp16", ["zero.precision=fp16", "trainer=ddp", "allowed: fp32, bf16", "trainer=zeropp"]),
        ("fsdp2", "topology.tp=2", ["topology.tp=2", "trainer=fsdp2", "trainer=zeropp only"]),
    ],
)
def test_a_setting_the_trainer_does_not_honour_is_refused_by_its_spec(
    trainer: str, override: str, words: list[str]
) -> None:
    with pytest.raises(ConfigError) as e:
        from_dict(composed_config(f"trainer={trainer}", override))
    for w in words:
        assert w in str(e.value), str(e.value)
    assert "QuantSpec(" not in str(e.value), str(e.value)


def test_an_unregistered_trainer_is_refused_with_the_registered_ones() -> None:
    with pytest.raises(ConfigError, match=r"trainer='toy'; allowed: zeropp, fsdp2, fsdp2_zeropp, ddp, ddp_zeropp"):
        from_dict(_cfg(trainer={"name": "toy"}))


def test_a_registered_toy_trainer_is_validated_by_its_spec(toy: TrainerSpec) -> None:
    rc = from_dict(_cfg(trainer={"name": "toy"}))
    assert rc.trainer.name == "toy" and rc.describe().startswith("toy ")
    refused = [
        ({"zero": {"grad_clip": 1.0}}, ["zero.grad_clip=1.0", "trainer=toy", "zero.{grad_accum_steps, precision}"]),
        ({"zero": {"stage": 1}}, ["stage=1", "the toy replicates everything", "trainer=zeropp"]),
        ({"zero": {"precision": "bf16"}}, ["zero.precision=bf16", "allowed: fp32", "trainer=zeropp / trainer=fsdp2"]),
        ({"train": {"checkpoint_every": 2}}, ["train.checkpoint_every=2", "cannot save or load", "trainer=zeropp"]),
    ]
    for extra, words in refused:
        with pytest.raises(ConfigError) as e:
            from_dict(_cfg(trainer={"name": "toy"}, **extra))
        for w in words:
            assert w in str(e.value), (extra, str(e.value))
    with pytest.raises(ConfigError, match="resume=true with trainer=toy"):
        from_dict({**_cfg(trainer={"name": "toy"}), "resume": True})
    # a key the toy honours, and settings of other sections, go through
    assert from_dict(_cfg(trainer={"name": "toy"}, zero={"grad_accum_steps": 2})).zero.grad_accum_steps == 2


def test_build_trainer_calls_the_registered_builder(toy: TrainerSpec) -> None:
    import torch

    rc = from_dict(_cfg(trainer={"name": "toy"}))
    assert isinstance(build_trainer(rc, torch.device("cpu")), ToyTrainer)


def test_registering_twice_or_a_malformed_spec_is_refused(toy: TrainerSpec) -> None:
    with pytest.raises(ValueError, match="'toy' is registered already"):
        register_trainer(TOY_SPEC)
    base = dict(name="x", builder="m:f", stage_note="n", honours=frozenset({"zero.grad_clip"}), fixed_stage=0)
    bad = [
        ({"name": "no-dash"}, "Python identifier"),
        ({"builder": "module_only"}, "'<module>:<callable>'"),
        ({"honours": frozenset({"train.steps"})}, "not zero.* keys"),
        ({"honours": frozenset({"zero.grad_clip"}), "stage_note": ""}, "stage_note"),
        ({"precisions": ("fp8",)}, "precisions"),
        ({"needs_any_of": ("zero.grads",)}, "go together"),
        ({"needs_any_of": ("grads",), "needs_message": "m"}, "zero.* keys only"),
        ({"requires": "deepspeed"}, "requires and install_hint go together"),
        ({"honours": frozenset({"zero.grad_clip"}), "fixed_stage": None}, "fixed_stage: set it exactly when"),
        ({"honours": None, "fixed_stage": 0}, "fixed_stage: set it exactly when"),
        ({"fixed_stage": 4}, r"fixed_stage=4: a ZeRO stage 0-3"),
    ]
    for change, words in bad:
        with pytest.raises(ValueError, match=words.replace("*", r"\*")):
            TrainerSpec(**{**base, **change})  # type: ignore[arg-type]


def test_a_builder_that_does_not_resolve_says_which(toy: TrainerSpec) -> None:
    spec = dataclasses.replace(TOY_SPEC, builder="tests.toy_trainer:TOY_SPEC")
    with pytest.raises(TypeError, match="trainer=toy: builder 'tests.toy_trainer:TOY_SPEC' is not callable"):
        resolve_builder(spec)
    with pytest.raises(AttributeError):
        resolve_builder(dataclasses.replace(TOY_SPEC, builder="tests.toy_trainer:NoSuchTrainer"))


def test_sweep_trainers_lists_every_trainer_without_an_optional_package() -> None:
    """conf/sweep/trainers.yaml names its jobs by hand: they are the registry's trainers, less those
    needing an optional package (DeepSpeed), which CI does not install."""
    import yaml

    from zeropp.experiments.runner.config import CONF_DIR

    doc = yaml.safe_load((CONF_DIR / "sweep" / "trainers.yaml").read_text())
    listed = doc["hydra"]["sweeper"]["params"]["+trainer_job"].split(",")
    assert sorted(listed) == sorted(n for n, s in TRAINER_SPECS.items() if s.in_trainer_sweep)
    assert "deepspeed" in TRAINER_SPECS and not TRAINER_SPECS["deepspeed"].in_trainer_sweep


DS = {**SMALL, "trainer": {"name": "deepspeed"}}


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"zero": {"weights": {"bits": 8}}}, ["zero.weights", "trainer=deepspeed", "trainer=fsdp2_zeropp"]),
        ({"zero": {"offload_optimizer": "cpu"}}, ["zero.offload_optimizer='cpu'", "trainer=zeropp"]),
        ({"zero": {"precision": "fp16"}}, ["zero.precision=fp16", "allowed: fp32, bf16", "trainer=zeropp"]),
        ({"topology": {"nodes": 1, "ranks_per_node": 2, "tp": 2}}, ["topology.tp=2", "trainer=zeropp only"]),
        ({"train": {"checkpoint_every": 2}}, ["train.checkpoint_every=2", "cannot save or load"]),
    ],
)
def test_trainer_deepspeed_refuses_what_its_spec_does_not_honour(extra: dict, words: list[str]) -> None:
    with pytest.raises(ConfigError) as e:
        from_dict({**DS, **extra})
    for w in words:
        assert w in str(e.value), str(e.value)


def test_trainer_deepspeed_takes_its_stage_and_names_itself() -> None:
    rc = from_dict({**DS, "zero": {"stage": 2, "grad_clip": 1.0, "grad_accum_steps": 2}})
    assert rc.zero.stage == 2 and rc.describe().startswith("deepspeed ZeRO-2 ")
    assert from_dict({**SMALL, "zero": {"stage": 2}}).describe().startswith("ZeRO-2 ")


def test_trainer_deepspeed_without_deepspeed_is_refused_before_any_rank(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSpeed made unimportable: the runner's job refuses the config with the install hint, and
    no rank started (the run directory holds no rank logs)."""
    import sys

    from zeropp.experiments.runner.run import run_job

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # importlib.util.find_spec now answers None
    overrides = ["trainer=deepspeed", "stage=3", "model=tiny", "topology=1x2", "data=random", "logger=none"]
    with pytest.raises(ConfigError) as e:
        run_job(overrides, tmp_path / "run")
    assert "trainer=deepspeed needs DeepSpeed: pip install 'zeropp[peers]'" in str(e.value)
    assert "trainer=zeropp / trainer=fsdp2" in str(e.value) and "trainer=deepspeed /" not in str(e.value)
    assert not (tmp_path / "run" / "ranks").exists()


def test_consumers_ask_the_spec_what_the_trainer_is() -> None:
    """The ZeRO memory formulas and the plan describe ZeroEngine only; the pre-flight's model state
    is the trainer's fixed stage (FSDP2: 3, DDP: 0) or its own ``stage``."""
    from zeropp.experiments.runner.metrics import expected_model_state
    from zeropp.experiments.runner.plan_draw import check_plannable
    from zeropp.experiments.runner.preflight import model_state_per_rank

    def rc(name: str, stage: int | None = None):
        return from_dict({**SMALL, "trainer": {"name": name}, "zero": {} if stage is None else {"stage": stage}})

    assert expected_model_state(rc("zeropp", 3), 1000) is not None
    for name in ("deepspeed", "ddp", "fsdp2"):
        assert expected_model_state(rc(name), 1000) is None
        with pytest.raises(ConfigError, match=f"trainer={name}; the plan describes ZeroEngine's step"):
            check_plannable(rc(name))
    check_plannable(rc("zeropp", 3))
    assert model_state_per_rank(rc("fsdp2")) == model_state_per_rank(rc("zeropp", 3))
    assert model_state_per_rank(rc("ddp")) == model_state_per_rank(rc("zeropp", 0))
    assert model_state_per_rank(rc("deepspeed", 2)) == model_state_per_rank(rc("zeropp", 2))
    assert model_state_per_rank(rc("zeropp", 3)) != model_state_per_rank(rc("zeropp", 0))
