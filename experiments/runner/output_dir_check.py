"""The run's (or sweep's) output directory as Hydra will use it, checked before Hydra writes there.

Hydra composes ``hydra.run.dir`` / ``hydra.sweep.dir`` from every config source: the package's
``conf/config.yaml`` (``outputs/<date>/<time>``), a user's yaml (a group option with
``# @package _global_``, a ``--config-dir``, an edited ``conf/config.yaml``) and the command line.
Only the command line is known before Hydra starts (``overrides.check_overrides`` checks a directory
named there); the folder a config file sets is known once Hydra has composed the config. So
:class:`OutputDirCheck`, a Hydra callback, checks the directory Hydra resolved, at ``on_run_start`` / ``on_multirun_start``: after composing,
before ``run_job`` (or the sweep's launcher) creates it and writes its ``.hydra/`` files. A directory
this process cannot create files in, or on a full disk, is one ``error:`` line and exit 2 instead of
Hydra's ``OSError`` traceback; a folder the config puts elsewhere is not refused for the state of
the default ``outputs/``. The runner registers it on Hydra's command line (:data:`REGISTER`),
not in the package's ``conf/config.yaml``: a user's own primary config (``--config-dir`` with a
``config.yaml`` that does not inherit ``/config``) then gets the check too.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .config import ConfigError
from .preflight import check_writable_dir

__all__ = ["REGISTER", "OutputDirCheck", "check_output_dir", "output_dir"]

REGISTER = "++hydra.callbacks.output_dir._target_=zeropp.experiments.runner.output_dir_check.OutputDirCheck"
"""The Hydra override that registers :class:`OutputDirCheck` whatever the primary config (``++``:
added, or set where a config already names a callback ``output_dir``)."""


def output_dir(config: DictConfig, key: str) -> str | None:
    """``key`` (``hydra.run.dir`` / ``hydra.sweep.dir``) of the composed ``config`` resolved as Hydra
    resolves it when it creates the directory (``${now:...}``, ``${hydra:...}``); None where it does
    not resolve (Hydra reports that itself)."""
    try:
        HydraConfig.instance().set_config(config)  # as run_job does first: ${hydra:...} resolves
        value = OmegaConf.select(config, key, throw_on_resolution_failure=True)
    except (OmegaConfBaseException, ValueError, KeyError):
        return None
    return None if value is None else str(value)


def check_output_dir(config: DictConfig, key: str) -> None:
    """Raise :class:`ConfigError` when the composed ``config``'s ``key`` names a directory this
    process cannot create files in (or create), or one on a full disk (``preflight.check_writable_dir``),
    or an empty path (Hydra would write into the current directory)."""
    value = output_dir(config, key)
    if value is None:
        return
    if not value.strip():
        raise ConfigError(
            f"invalid config: {key}= (set in a config file) is an empty path, which would put this command's "
            f"outputs straight into the current directory; name the directory there, or give {key}=... on "
            "the command line"
        )
    check_writable_dir(key, Path(value))


class OutputDirCheck(Callback):
    """Hydra callback (module doc): the composed output directory, checked before Hydra creates it."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _check_or_exit(config, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _check_or_exit(config, "hydra.sweep.dir")


def _check_or_exit(config: DictConfig, key: str) -> None:
    """One ``error:`` line and exit 2, as the runner's other checks before any rank starts."""
    try:
        check_output_dir(config, key)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
