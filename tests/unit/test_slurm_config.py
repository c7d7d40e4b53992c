"""The ``slurm.*`` section and the checks made before a Slurm sweep submits anything."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from hydra import compose, initialize_config_module

from zeropp.experiments.runner import schema, slurm_launcher
from zeropp.experiments.runner.config import ConfigError, from_omegaconf
from zeropp.experiments.runner.slurm import (
    SlurmConfig,
    check_slurm_job,
    check_slurm_keys,
    check_slurm_launch,
    selects_slurm,
)


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


def test_a_point_job_is_one_task_on_one_node_and_uses_its_gpus() -> None:
    """hydra.launcher.nodes / tasks_per_node > 1 would run the whole point once per task into one
    directory; GPUs with launcher.device=cpu would sit idle: refused with the fix."""
    check_slurm_job({"nodes": 1, "tasks_per_node": 1, "gpus_per_node": None}, "cpu")
    check_slurm_job({"nodes": 1, "tasks_per_node": 1, "gpus_per_node": 4}, "auto")
    check_slurm_job({"nodes": 1, "tasks_per_node": 1, "gpus_per_node": 4}, "cuda")
    for key in ("nodes", "tasks_per_node"):
        with pytest.raises(ConfigError) as e:
            check_slurm_job({"nodes": 1, "tasks_per_node": 1, key: 2}, "auto")
        assert f"hydra.launcher.{key}=2" in str(e.value) and "scripts/slurm/train.sbatch" in str(e.value)
    with pytest.raises(ConfigError) as e:
        check_slurm_job({"nodes": 1, "tasks_per_node": 1, "gpus_per_node": 2}, "cpu", "stage=3")
    assert "point stage=3: slurm.gpus_per_node=2" in str(e.value) and "launcher.device=cuda" in str(e.value)


class _Loader:
    def load_sweep_config(self, config: Any, overrides: list[str]) -> Any:
        return _compose(["hydra/launcher=slurm", *overrides])[0]


def _launcher(**params: Any) -> Any:
    cfg, _ = _compose(["hydra/launcher=slurm"])
    resolved = {"nodes": 1, "tasks_per_node": 1, "gpus_per_node": None, **params}
    return SimpleNamespace(
        params=resolved, config=cfg, hydra_context=SimpleNamespace(config_loader=_Loader()), task_function=print
    )


def test_a_job_that_cannot_run_as_asked_is_refused_before_sbatch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(slurm_launcher, "check_slurm_launch", lambda argv: None)  # no sbatch needed here
    submitted: list[object] = []
    with pytest.raises(SystemExit) as e:
        slurm_launcher.launch_recording_failures(
            _launcher(nodes=2), lambda *a: submitted.append(a) or [], [["stage=2"], ["stage=3"]], 0
        )
    assert e.value.code == 2 and submitted == []
    assert "error: invalid config: hydra.launcher.nodes=2" in capsys.readouterr().err


def test_sbatch_refusing_the_submission_is_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    """A partition that does not exist (or no controller): sbatch's words and what to check, exit
    2, not submitit's traceback; a submission sbatch takes returns the plugin's results."""
    from submitit.core.utils import FailedJobError

    def refused(*args: object) -> list[object]:
        raise FailedJobError(
            "sbatch: error: invalid partition specified: nosuch\nsbatch: error: Batch job submission failed"
        )

    with pytest.raises(SystemExit) as e:
        slurm_launcher.submit(refused, [["stage=3"]], 0)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: sbatch refused the sweep's jobs, so none was submitted: ")
    assert "invalid partition specified: nosuch" in err and "slurm.partition" in err
    assert slurm_launcher.submit(lambda *a: iter(["ok"]), [["stage=3"]], 0) == ["ok"]
