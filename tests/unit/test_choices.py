"""Fixed-choice settings are ``str`` enums declared once (``zeropp.comm.choices``, ``zeropp.runtime.choices``,
the harness's in ``experiments/runner/checks.py``).

* a bad value is refused while Hydra composes (OmegaConf's enum node, the reference) and, first,
  by the runner's pre-check with one line naming the key, the valid values and the closest one;
* a valid value becomes the member, which still compares, hashes and formats as its string;
* what is written (``RunConfig.to_dict`` for summaries and wandb, a config's ``repr`` in
  checkpoint metadata) holds plain strings: ``yaml.safe_dump`` would refuse an enum member.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml
from hydra.errors import HydraException
from omegaconf.errors import ValidationError

from tests.cli_helpers import run_cli
from tests.experiment_helpers import composed_config
from zeropp.comm import QuantSpec, Rotation, Rounding
from zeropp.experiments.runner.checks import LauncherDevice, LoggerMode
from zeropp.experiments.runner.config import ConfigError, from_dict
from zeropp.experiments.runner.overrides import check_overrides
from zeropp.runtime import MemoryTier, OffloadTier, OptimizerConfig, Precision, QuantizeFrozen, Schedule, ZeroConfig

BAD = [
    ([], "zero.precision=fp8", Precision, None),
    ([], "zero.precision=bf61", Precision, "bf16"),
    ([], "zero.offload_param=gpu", OffloadTier, None),
    (["stage=2"], "zero.offload_optimizer=nvm", OffloadTier, "nvme"),
    ([], "zero.quantize_frozen=int2", QuantizeFrozen, None),
    ([], "optim.schedule=linear", Schedule, None),
    (["quant=int8"], "zero.weights.rounding=stochastc", Rounding, "stochastic"),
    (["quant=qgz"], "zero.grads.rotation=hadamad", Rotation, "hadamard"),
    ([], "launcher.device=gpu", LauncherDevice, None),
    ([], "logger.mode=onlin", LoggerMode, "online"),
]


@pytest.mark.parametrize("context, arg, choice, near", BAD)
def test_a_bad_choice_names_the_key_and_the_valid_values(context, arg, choice, near) -> None:
    key, value = arg.split("=")
    with pytest.raises(ConfigError) as e:
        check_overrides([*context, arg])
    msg = str(e.value)
    assert f"{key}={value}" in msg and all(v in msg for v in choice.values()), msg
    if near is not None:
        assert f"did you mean {key}={near}?" in msg, msg
    with pytest.raises((HydraException, ValidationError)) as ref:  # the reference: composing refuses it too
        composed_config(*context, arg)
    chain = f"{ref.value} {ref.value.__cause__}"
    assert all(v in chain for v in choice.values()), chain


def test_a_bad_choice_on_the_command_line_exits_2(tmp_path, monkeypatch, capfd) -> None:
    code, err = run_cli(["zero.precision=fp8"], tmp_path / "run", monkeypatch, capfd)
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "zero.precision=fp8" in lines[0] and "allowed: fp32, bf16, fp16" in lines[0], lines[0]


def test_a_bad_choice_from_a_dict_names_the_key() -> None:
    """A config that bypasses Hydra (a job spec read back as JSON) is checked by the library classes."""
    d = composed_config()
    d["zero"]["precision"] = "fp8"
    with pytest.raises(ConfigError, match=r"zero\.precision must be one of \['bf16', 'fp16', 'fp32'\], got 'fp8'"):
        from_dict(d)


@pytest.mark.parametrize("arg", ["zero.precision=bf16", "zero.offload_optimizer=cpu", "optim.schedule=cosine"])
def test_good_choices_pass_the_precheck_and_compose(arg: str) -> None:
    check_overrides([arg])
    key, value = arg.split("=")
    rc = from_dict(composed_config(arg))
    got = getattr(getattr(rc, key.split(".")[0]), key.split(".")[1])
    assert got == value and isinstance(got, str) and type(got) is not str  # the member, equal to its string


def test_members_are_their_strings() -> None:
    z = ZeroConfig(precision="bf16", offload_optimizer="cpu", stage=2)
    assert z.precision is Precision.bf16 and z.offload_optimizer is OffloadTier.cpu
    assert z.precision == "bf16" and hash(z.precision) == hash("bf16") and {"bf16": 1}[z.precision] == 1
    assert f"{z.precision}" == str(z.precision) == "bf16" and json.dumps(z.precision) == '"bf16"'
    assert z == ZeroConfig(precision=Precision.bf16, offload_optimizer=OffloadTier.cpu, stage=2)
    q = QuantSpec(bits=4, rounding="stochastic", rotation="hadamard")
    assert q.rounding is Rounding.stochastic and q.rotation is Rotation.hadamard and q.stochastic
    assert OptimizerConfig(schedule="cosine", decay_steps=10).schedule is Schedule.cosine
    for bad in (
        lambda: ZeroConfig(precision="fp8"),
        lambda: ZeroConfig(offload_param=3),
        lambda: QuantSpec(bits=8, rounding="up"),
        lambda: OptimizerConfig(schedule="linear"),
    ):
        with pytest.raises(ValueError, match="one of"):
            bad()


def test_what_is_written_holds_plain_strings() -> None:
    """Summaries and wandb get ``RunConfig.to_dict()``; checkpoint metadata the config's repr."""
    rc = from_dict(
        composed_config(
            "quant=zeropp", "zero.precision=bf16", "zero.grads.rounding=stochastic", "optim.schedule=cosine"
        )
    )
    with pytest.raises(yaml.representer.RepresenterError):  # the fault: an enum member in a YAML dump
        yaml.safe_dump(dataclasses.asdict(rc.zero))
    d = rc.to_dict()
    assert type(d["zero"]["precision"]) is str and type(d["zero"]["grads"]["rounding"]) is str
    assert type(d["optim"]["schedule"]) is str
    assert yaml.safe_load(yaml.safe_dump(d)) == json.loads(json.dumps(d))  # both writers take it
    assert from_dict(json.loads(json.dumps(d))) == rc  # a job spec read back builds the same run
    text = repr(rc.zero)
    assert "precision='bf16'" in text and "rounding='stochastic'" in text and "Precision." not in text


def test_tier_names_are_declared_once() -> None:
    from zeropp.runtime import activations, memory, optimizer
    from zeropp.runtime.config import OFFLOAD_TIERS

    assert memory.TIERS == activations.TIERS == optimizer.TIERS == MemoryTier.values() == ("device", "host", "disk")
    assert memory.OFFLOAD_CHOICES == OFFLOAD_TIERS == OffloadTier.values() == ("none", "cpu", "nvme")
    assert memory.OFFLOAD_TIER == {"none": "device", "cpu": "host", "nvme": "disk"}
    assert all(type(t) is str for t in memory.TIERS)  # plain dict keys in memory reports
