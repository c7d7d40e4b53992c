"""Slurm for sweeps: the ``slurm.*`` config section and the checks made before anything is submitted.

``python -m experiments.run -m sweep=bits hydra/launcher=slurm`` runs each point of the sweep as
its own Slurm job through Hydra's submitit launcher (the ``slurm`` extra,
``hydra-submitit-launcher``). ``conf/hydra/launcher/slurm.yaml`` builds on the plugin's
``submitit_slurm`` and feeds its partition, time limit, GPUs and CPUs from this section, so a
sweep's resources are typed and validated like every other setting (:class:`SlurmConfig`); any
other sbatch option is the plugin's own ``hydra.launcher.<option>=...`` (e.g.
``hydra.launcher.account=...``). Each point is one node: the runner inside the job starts the
point's ranks on that node as the local launcher does; a job over several nodes is
``scripts/slurm/train.sbatch`` (``srun torchrun``).

What is checked before Hydra submits anything (:func:`check_slurm_launch`): the extra is
installed and ``sbatch`` is on PATH; and with any other launcher, ``slurm.*`` keys set away from
their defaults are refused (:func:`check_slurm_keys`), since nothing would read them.
"""

from __future__ import annotations

import dataclasses
import importlib
import shutil
from typing import Any, Mapping, Optional, Sequence

from .checks import ConfigError, check, pos_int

__all__ = ["LAUNCHER_CHOICE", "PLUGIN_MODULE", "SlurmConfig", "check_slurm_keys", "check_slurm_launch", "selects_slurm"]

LAUNCHER_CHOICE = "slurm"
"""``hydra/launcher=slurm``: the option name of ``conf/hydra/launcher/slurm.yaml``."""

PLUGIN_MODULE = "hydra_plugins.hydra_submitit_launcher"
"""The Hydra plugin the ``slurm`` extra installs (``hydra-submitit-launcher``)."""

INSTALL_HINT = "pip install 'zeropp[slurm]' (or pip install -e '.[slurm]' in a clone)"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlurmConfig:
    """Resources of each Slurm job a sweep submits (``hydra/launcher=slurm``): one job per point,
    on one node."""

    partition: Optional[str] = None
    """Slurm partition (``sbatch --partition``); None: the cluster's default partition."""
    time_min: int = 60
    """Time limit of each job in minutes (``sbatch --time``); Slurm stops a job past it."""
    gpus_per_node: Optional[int] = None
    """GPUs of each job (``sbatch --gpus-per-node``); None: ask for none (CPU ranks, or a cluster
    that hands GPUs out by partition). Set ``launcher.device=cuda`` to make the ranks use them."""
    cpus_per_task: Optional[int] = None
    """CPUs of each job (``sbatch --cpus-per-task``; one task per job); None: Slurm's default."""

    def __post_init__(self) -> None:
        if self.partition is not None:
            check(
                isinstance(self.partition, str)
                and self.partition != ""
                and not any(c.isspace() for c in self.partition),
                "slurm.partition",
                self.partition,
                "a partition name (no spaces), or null for the default partition",
            )
        pos_int("slurm.time_min", self.time_min)
        if self.gpus_per_node is not None:
            pos_int("slurm.gpus_per_node", self.gpus_per_node)
        if self.cpus_per_task is not None:
            pos_int("slurm.cpus_per_task", self.cpus_per_task)


def selects_slurm(argv: Sequence[str]) -> bool:
    """Whether the command line picks ``hydra/launcher=slurm``."""
    return any(a.split("=", 1) == ["hydra/launcher", LAUNCHER_CHOICE] for a in argv)


def check_slurm_launch(argv: Sequence[str], which: Any = shutil.which) -> None:
    """With ``hydra/launcher=slurm`` on the command line: the submitit plugin is importable and
    ``sbatch`` is on PATH (``which``: how to look it up), else :class:`ConfigError` saying what to
    install. Runs before Hydra composes anything, so nothing is submitted and no directory made."""
    if not selects_slurm(argv):
        return
    if "-m" not in argv and "--multirun" not in argv and not any(a.startswith("sweep=") for a in argv):
        raise ConfigError(
            "invalid launch: hydra/launcher=slurm submits the points of a sweep; add -m (or sweep=<name>). "
            "For one job on Slurm, submit scripts/slurm/train.sbatch"
        )
    try:  # imported, not only found: a plugin whose own dependency (submitit) is missing cannot launch either
        importlib.import_module(PLUGIN_MODULE + ".submitit_launcher")
        importlib.import_module("submitit")
    except ImportError as e:
        raise ConfigError(
            f"hydra/launcher=slurm needs the Slurm extra (Hydra's submitit launcher), which is not "
            f"installed ({e}): {INSTALL_HINT}"
        ) from None
    if which("sbatch") is None:
        raise ConfigError(
            "hydra/launcher=slurm submits with sbatch, which is not on PATH: run the sweep on a Slurm "
            "login node (or add Slurm's bin directory to PATH), or drop hydra/launcher=slurm to run "
            "the points here one after another"
        )


def check_slurm_keys(values: Mapping[str, Any], launcher_choice: Optional[str]) -> None:
    """``slurm.*`` keys set away from their defaults with a launcher other than ``slurm`` do
    nothing: refused with the fix (nothing is silently ignored)."""
    if launcher_choice == LAUNCHER_CHOICE:
        return
    for f in dataclasses.fields(SlurmConfig):
        if f.name in values and values[f.name] != f.default:
            raise ConfigError(
                f"invalid config: slurm.{f.name}={values[f.name]!r} does nothing with "
                f"hydra/launcher={launcher_choice or 'basic'}; slurm.* are the resources of the jobs "
                "hydra/launcher=slurm submits. Add hydra/launcher=slurm (with -m), or remove it"
            )
