"""Config validation: a wrong override names the key and the allowed values, before any rank starts."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from zeropp.experiments.config import ConfigError, check_zero_runtime, from_dict, from_omegaconf
from zeropp.experiments.overrides import check_overrides


def _cfg(*overrides: str) -> dict:
    with initialize_config_module(config_module="zeropp.conf", version_base="1.3"):
        return OmegaConf.to_container(compose("config", overrides=list(overrides)), resolve=True)  # type: ignore[return-value]


def test_defaults_are_the_main_job() -> None:
    rc = from_dict(_cfg("stage=3", "quant=int8"))
    assert (rc.zero.stage, rc.zero.qwz_bits, rc.zero.hpz, rc.zero.qgz_bits) == (3, 8, False, None)
    assert (rc.topology.world_size, rc.topology.ranks_per_node, rc.topology.nodes) == (4, 2, 2)
    assert rc.trainer.name == "zeropp" and rc.data.kind == "text" and rc.logger.mode == "offline"
    rc = from_dict(_cfg("quant=zeropp"))
    assert (rc.zero.qwz_bits, rc.zero.hpz, rc.zero.qgz_bits) == (8, True, 4)


def test_every_preset_composes() -> None:
    from zeropp.experiments.overrides import group_options

    for group in ("quant", "model", "data", "topology", "trainer", "logger", "cluster"):
        for opt in group_options(group):
            extra = ["quant=qgz"] if (group, opt) == ("trainer", "ddp_zeropp") else []
            from_dict(_cfg(f"{group}={opt}", *extra))


@pytest.mark.parametrize("override, words", [
    ("stage=5", ["stage=5", "0, 1, 2, 3"]),
    ("zero.qwz_bits=6", ["zero.qwz_bits=6", "8, 4"]),
    ("train.steps=0", ["train.steps=0", ">= 1"]),
    ("train.precision=fp8", ["train.precision", "fp32, bf16, fp16"]),
    ("model.n_heads=3", ["model.n_heads=3", "d_model"]),
])
def test_bad_value_names_key_and_allowed(override: str, words: list[str]) -> None:
    with pytest.raises(ConfigError) as e:
        from_dict(_cfg(override))
    for w in words:
        assert w in str(e.value)


def test_bad_topology() -> None:
    with pytest.raises(ConfigError) as e:
        from_dict(_cfg("topology.world_size=5", "topology.ranks_per_node=2"))
    assert "topology.ranks_per_node=2" in str(e.value) and "world_size=5" in str(e.value)
    assert "[1, 5]" in str(e.value)


def test_unknown_key_suggests() -> None:
    d = _cfg()
    d["train"]["stepz"] = 3
    with pytest.raises(ConfigError, match=r"train\.stepz.*did you mean train\.steps"):
        from_dict(d)


def test_runtime_checks_surface_as_config_errors() -> None:
    with pytest.raises(ConfigError, match="hpz_size"):
        check_zero_runtime(from_dict(_cfg("quant=zeropp", "zero.hpz_size=3")))


def test_command_line_precheck() -> None:
    with pytest.raises(ConfigError) as e:
        check_overrides(["quant=int9"])
    assert "quant='int9'" in str(e.value) and "int8" in str(e.value) and "zeropp" in str(e.value)
    with pytest.raises(ConfigError, match="quant=none,int9|int9"):
        check_overrides(["-m", "quant=none,int9"])
    with pytest.raises(ConfigError, match="did you mean quant"):
        check_overrides(["quantt=int8"])
    check_overrides(["stage=3", "quant=int8", "train.steps=3", "hydra.run.dir=x", "+foo=1"])


def test_command_line_precheck_of_section_keys() -> None:
    """A misspelt key names the section's keys; a key of another group option names that option."""
    with pytest.raises(ConfigError, match=r"train\.stepz.*did you mean train\.steps.*micro_batch_size"):
        check_overrides(["train.stepz=3"])
    with pytest.raises(ConfigError, match=r"cluster\.inter_gbps does not apply to cluster=local.*cluster=emulated"):
        check_overrides(["cluster.inter_gbps=1"])
    with pytest.raises(ConfigError, match=r"reshard_after_forward.*trainer=zeropp.*trainer=fsdp2"):
        check_overrides(["trainer.reshard_after_forward=2"])
    check_overrides(["cluster=emulated", "cluster.inter_gbps=1", "trainer=fsdp2", "trainer.reshard_after_forward=2",
                     "zero.hpz_size=2", "model.d_model=128", "+train.extra=1"])


def test_cli_errors_exit_fast_without_ranks(tmp_path) -> None:
    for args, words in ((["quant=int9"], ["quant", "allowed", "int8"]),
                        (["topology.world_size=5", "topology.ranks_per_node=2"], ["topology.ranks_per_node", "[1, 5]"])):
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "zeropp.experiments.run", *args, f"hydra.run.dir={tmp_path}"],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 2, p.stderr
        assert all(w in p.stderr for w in words), p.stderr
        assert time.monotonic() - t0 < 30
        assert not (tmp_path / "ranks").exists()  # nothing was started


def test_omegaconf_entry() -> None:
    with initialize_config_module(config_module="zeropp.conf", version_base="1.3"):
        rc = from_omegaconf(compose("config", overrides=["trainer=fsdp2"]))
    assert rc.trainer.name == "fsdp2"


def test_stochastic_rounding_keys() -> None:
    """zero.qwz_stochastic / zero.qgz_stochastic reach zeropp.runtime.ZeroConfig; they need their bits,
    and a stage that drops a switch drops its stochastic flag with it."""
    from zeropp.experiments.trainers import zero_config

    check_overrides(["zero.qwz_stochastic=true", "zero.qgz_stochastic=true"])
    assert (from_dict(_cfg()).zero.qwz_stochastic, from_dict(_cfg()).zero.qgz_stochastic) == (False, False)
    rc = from_dict(_cfg("quant=zeropp", "zero.qwz_stochastic=true", "zero.qgz_stochastic=true"))
    check_zero_runtime(rc)
    zc = zero_config(rc)
    assert (zc.qwz_stochastic, zc.qgz_stochastic, zc.qwz_bits, zc.qgz_bits) == (True, True, 8, 4)
    rc = from_dict(_cfg("stage=2", "quant=zeropp", "zero.qwz_stochastic=true", "zero.qgz_stochastic=true"))
    check_zero_runtime(rc)  # qwZ (and its flag) is off below stage 3
    assert (rc.zero.effective().qwz_stochastic, rc.zero.effective().qgz_stochastic) == (False, True)
    for overrides, key in ((["quant=none", "zero.qwz_stochastic=true"], "zero.qwz_stochastic"),
                           (["quant=int8", "zero.qgz_stochastic=true"], "zero.qgz_stochastic")):
        with pytest.raises(ConfigError, match=key + r"=True.*" + key.replace("stochastic", "bits")):
            from_dict(_cfg(*overrides))
    with pytest.raises(ConfigError, match=r"zero\.qgz_stochastic=2.*true, false"):
        from_dict(_cfg("quant=zeropp", "zero.qgz_stochastic=2"))
    p = subprocess.run([sys.executable, "-m", "zeropp.experiments.run", "--help"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0 and "qwz_stochastic: false" in p.stdout and "qgz_stochastic: false" in p.stdout, p.stderr
