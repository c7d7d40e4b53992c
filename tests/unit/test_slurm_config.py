"""The ``slurm.*`` section and the checks made before a Slurm sweep submits anything."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module

from zeropp.experiments.runner import schema
from zeropp.experiments.runner.config import ConfigError, from_omegaconf
from zeropp.experiments.runner.slurm import SlurmConfig, check_slurm_keys, check_slurm_launch, selects_slurm


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"time_min": 0}, ["slurm.time_min=0", "integer >= 1"]),
        ({"gpus_per_node": -1}, ["slurm.gpus_per_node=-1"]),
        ({"cpus_per_task": 0}, ["slurm.cpus_per_task=0"]),
        ({"partition": "gpu large"}, ["slurm.partition='gpu large'", "no spaces"]),
        ({"partition": ""}, ["slurm.partition=''"]),
    ],
)
def test_bad_slurm_values_are_refused(kw: dict, words: list[str]) -> None:
    with pytest.raises(ConfigError) as e:
        SlurmConfig(**kw)
    assert all(w in str(e.value) for w in words), str(e.value)


def _compose(overrides: list[str]):
    from omegaconf import OmegaConf

    schema.register()
    with initialize_config_module("zeropp.conf", version_base="1.3"):
        cfg = compose("config", overrides=overrides, return_hydra_config=True)
    return cfg, OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])


def test_slurm_section_is_part_of_the_validated_config() -> None:
    _, cfg = _compose(["slurm.partition=gpu", "slurm.time_min=30", "slurm.gpus_per_node=4", "logger=none"])
    rc = from_omegaconf(cfg)
    assert rc.slurm == SlurmConfig(partition="gpu", time_min=30, gpus_per_node=4)
    assert rc.to_dict()["slurm"]["partition"] == "gpu"
    _, bad = _compose(["slurm.time_min=-3", "logger=none"])
    with pytest.raises(ConfigError, match="slurm.time_min=-3"):
        from_omegaconf(bad)


def test_the_launcher_config_takes_its_resources_from_the_slurm_keys() -> None:
    """conf/hydra/launcher/slurm.yaml resolves partition, time, GPUs and CPUs from slurm.*."""
    overrides = ["hydra/launcher=slurm", "slurm.partition=gpu", "slurm.time_min=7", "slurm.gpus_per_node=2"]
    cfg, _ = _compose(overrides)
    launcher = cfg.hydra.launcher
    assert launcher._target_ == "hydra_plugins.zeropp_slurm_launcher.ZeroppSlurmLauncher"
    assert (launcher.partition, launcher.timeout_min, launcher.gpus_per_node, launcher.cpus_per_task) == (
        "gpu",
        7,
        2,
        None,
    )
    assert (launcher.nodes, launcher.tasks_per_node) == (1, 1)


def test_slurm_keys_without_the_slurm_launcher_are_refused() -> None:
    check_slurm_keys({"partition": None, "time_min": 60}, None)  # defaults: nothing to say
    check_slurm_keys({"partition": "gpu"}, "slurm")
    with pytest.raises(ConfigError) as e:
        check_slurm_keys({"partition": "gpu", "time_min": 60}, "basic")
    assert "slurm.partition='gpu' does nothing with hydra/launcher=basic" in str(e.value)
    assert "hydra/launcher=slurm" in str(e.value)


def test_slurm_launch_needs_a_sweep_and_sbatch() -> None:
    assert selects_slurm(["-m", "hydra/launcher=slurm"]) and not selects_slurm(["hydra/launcher=basic"])
    check_slurm_launch(["stage=3"], which=lambda _: None)  # not a Slurm launch: nothing checked
    with pytest.raises(ConfigError, match="add -m"):
        check_slurm_launch(["hydra/launcher=slurm"], which=lambda _: "/usr/bin/sbatch")
    with pytest.raises(ConfigError, match="sbatch, which is not on PATH"):
        check_slurm_launch(["-m", "hydra/launcher=slurm"], which=lambda _: None)
    check_slurm_launch(["sweep=bits", "hydra/launcher=slurm"], which=lambda _: "/usr/bin/sbatch")
