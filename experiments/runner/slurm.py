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
their defaults are refused (:func:`check_slurm_keys`), since nothing would read them. Once the
launcher is set up, before its one ``sbatch`` call (:func:`check_slurm_job`): each job is one
task on one node (the plugin's ``hydra.launcher.nodes`` / ``tasks_per_node`` would start the
whole run once per task, every copy writing the same run directory), and GPUs asked for are
used (``launcher.device=cpu`` leaves them idle).
"""

from __future__ import annotations

import dataclasses
import importlib
import shutil
from typing import Any, Mapping, Optional, Sequence

from .checks import ConfigError, check, pos_int

__all__ = [
    "LAUNCHER_CHOICE",
    "PLUGIN_MODULE",
    "SlurmConfig",
    "check_slurm_job",
    "check_slurm_keys",
    "check_slurm_launch",
    "selects_slurm",
]

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


def check_slurm_job(launcher_params: Mapping[str, Any], device: Any, point: str = "") -> None:
    """The job the plugin will submit for a point (``launcher_params``: its resolved
    ``hydra.launcher.*``; ``device``: the point's ``launcher.device``), refused with the fix when
    it cannot run as asked. Each job is one task on one node: the runner in it starts the point's
    ranks on that node, so a second node or task would run the whole point again, every copy
    writing the same run directory. GPUs asked for (``slurm.gpus_per_node``) with
    ``launcher.device=cpu`` would sit idle for the job's whole time."""
    for key in ("nodes", "tasks_per_node"):
        value = launcher_params.get(key, 1)
        if value != 1:
            raise ConfigError(
                f"invalid config: hydra.launcher.{key}={value!r}: each point of a Slurm sweep is one task on "
                "one node (the runner starts the point's ranks there; another task would run the whole point again "
                f"into the same directory). Remove hydra.launcher.{key}; for one run across nodes submit "
                "scripts/slurm/train.sbatch"
            )
    gpus = launcher_params.get("gpus_per_node")
    if gpus and str(device) == "cpu":
        raise ConfigError(
            f"invalid config: {f'point {point}: ' if point else ''}slurm.gpus_per_node={gpus!r} asks Slurm for GPUs that launcher.device=cpu "
            "leaves idle; remove slurm.gpus_per_node for CPU ranks, or set launcher.device=cuda (or auto)"
        )
