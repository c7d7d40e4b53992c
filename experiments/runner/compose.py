"""A run's configuration composed and validated exactly as ``python -m experiments.run`` and
:func:`experiments.runner.run.run_job` compose it, without starting anything: what a command that
runs several jobs (the convergence suite, the benchmarks) checks for every job before the first
starts, so that a bad setting is one usage error (exit 2) instead of the same failure once per job."""

from __future__ import annotations

from collections.abc import Sequence

from .config import RunConfig, from_omegaconf, without_hydra
from .overrides import check_overrides

__all__ = ["compose_run"]


def compose_run(overrides: Sequence[str]) -> RunConfig:
    """The validated config of one run (ConfigError naming the key when it is not one)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    from . import schema

    schema.register()
    check_overrides(list(overrides))
    with initialize_config_module("zeropp.conf", version_base="1.3"):
        cfg = hydra_compose("config", overrides=list(overrides))
    return from_omegaconf(without_hydra(cfg))
