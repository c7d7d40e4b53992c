"""``python -m experiments.run [overrides]``: the experiment runner (a thin Hydra app).

Composes the config (the schema generated from the library's dataclasses, ``schema.py``, plus
``conf/``), validates it into a :class:`config.RunConfig` before anything starts, then either
launches one process per rank (``launcher.py``) or, under torchrun, runs this process as its rank
(``worker.py``). Outputs land in Hydra's run directory: ``metrics.jsonl``, ``summary.json``,
``ranks/``, ``checkpoints/`` and ``wandb/``. Benchmarks call :func:`run_job` with overrides.
This module is the command (Hydra's task function, the exit statuses, a sweep's failed jobs);
one job's run is ``job.py``, the config against torchrun's layout ``launch_layout.py`` and a
sweep's checks before its first point ``sweep_checks.py`` (their public names are importable
from here too).

    python -m experiments.run stage=3 quant=int8
    python -m experiments.run -m stage=0,1,2,3
    python -m experiments.run sweep=trainers
    torchrun --standalone --nproc-per-node 4 -m zeropp.experiments.run stage=3 quant=int8

Exit status: 0 the run completed; 2 an invalid config (nothing started); 3 training diverged
(a non-finite loss or gradient norm, or ``train.max_skipped_steps`` fp16 overflows in a row: every
rank stopped at that step, ``summary.json`` says ``"status": "diverged"``, nothing of that step
was saved); 130 / 143 interrupted by SIGINT / SIGTERM (one line naming the last checkpoint; the
ranks exit quietly); otherwise a rank's failure (its exit code, 1 for an error, 128+N for signal N).
Under torchrun the nodes are torchrun's: ``topology.nodes`` / ``topology.ranks_per_node`` not given
on the command line are its agents and ``--nproc-per-node`` (the last example runs 1 node x 4), and
given ones must agree with them (:func:`validated`, :func:`check_launch`); the local launcher
instead poses ``topology=NxR`` (default 2x2) on this one host.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any, cast

import hydra
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch.distributed.elastic.multiprocessing.errors import record

from zeropp.runtime.divergence import DivergenceError

from ..launch.command import Terminated, sigterm_raises
from ..launch.failure import shell_status
from . import plugins, schema
from .config import ConfigError, RunDirTaken, RunFinished, RunNeverSaved, interpolation_error, without_hydra
from .job import FAILED_FILE, RunDiverged, execute, job_spec, last_checkpoint, recorded_divergence, run_job
from .launch_layout import LAYOUT_KEYS, check_launch, declared_layout, validated
from .launcher import RankFailure, RunInterrupted, in_torchrun
from .output_dir_check import REGISTER as REGISTER_OUTPUT_DIR_CHECK
from .overrides import check_fresh_outputs, check_overrides, check_single_run_values
from .slurm import check_slurm_keys, check_slurm_launch
from .sweep_checks import RESUME_MAY_CHANGE, check_resumed_point, check_sweep_points, sweep_point_began, sweep_point_dir

__all__ = [
    "FAILED_FILE",
    "LAYOUT_KEYS",
    "RESUME_MAY_CHANGE",
    "ConfigError",
    "RunDiverged",
    "check_launch",
    "check_overrides",
    "check_resumed_point",
    "check_sweep_points",
    "cli",
    "command_status",
    "declared_layout",
    "execute",
    "job_spec",
    "last_checkpoint",
    "note_failed_job",
    "recorded_divergence",
    "run_job",
    "sweep_point_began",
    "sweep_point_dir",
    "validated",
    "without_hydra",
]
"""``check_sweep_points`` and ``note_failed_job`` must be found here: the sweeper and the Slurm
launcher look them up in the task function's module (``hydra_plugins``, ``slurm_launcher.py``)."""

schema.register()
plugins.register()  # hydra/sweeper=zeropp, hydra/launcher=slurm: known to Hydra from any directory


def _run_dir_suffix(default: str) -> str:
    """Hydra's run-dir leaf: the time, or under torchrun a name every rank of the job shares
    (processes start seconds apart): the elastic run id, or for a static rendezvous (run id
    ``none``) the rendezvous address. Pass ``hydra.run.dir`` to choose the directory yourself."""
    if not in_torchrun():
        return default
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if run_id != "none":
        return f"torchrun-{run_id}"
    return f"torchrun-{os.environ['MASTER_ADDR']}-{os.environ['MASTER_PORT']}"


if not OmegaConf.has_resolver("zeropp_run"):
    OmegaConf.register_new_resolver("zeropp_run", _run_dir_suffix)


def _hydra_info(cfg: DictConfig | None = None) -> dict[str, Any]:
    """Run directory, overrides, names of the chosen group options, multirun group."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get() if cfg is None else cfg.hydra
    multirun = hc.mode == RunMode.MULTIRUN
    return {
        "run_dir": hc.runtime.output_dir,
        "overrides": list(hc.overrides.task),
        "name": hc.job.override_dirname or "defaults",
        "group": "_".join(Path(hc.sweep.dir).parts[-2:]) if multirun else None,
        "multirun": multirun,
        "model_name": hc.runtime.choices.get("model") or "",
        "launcher": hc.runtime.choices.get("hydra/launcher"),
    }


_failed: list[dict[str, Any]] = []  # this process's failed multirun jobs (Hydra runs them in-process, in order)


def _record_failure(info: dict[str, Any], error: str, exit_code: int) -> None:
    """In a multirun, keep going: note the failed job in its directory and for the final message."""
    job = {"run_dir": info["run_dir"], "overrides": info["overrides"], "error": error, "exit_code": exit_code}
    Path(info["run_dir"]).mkdir(parents=True, exist_ok=True)
    (Path(info["run_dir"]) / FAILED_FILE).write_text(json.dumps(job, indent=1) + "\n")
    note_failed_job(job)


def note_failed_job(job: dict[str, Any]) -> None:
    """Count a failed multirun job (``run_dir``, ``overrides``, ``error``, ``exit_code``) in this
    command's final message and exit status; the Slurm launcher calls it with the failures its
    jobs recorded on their nodes (``slurm_launcher.py``)."""
    _failed.append(job)


def command_status(e: ConfigError | RankFailure | DivergenceError) -> int:
    """The command's exit status for ``e`` (docs/reliability.md): 2 for an invalid config, the failing
    rank's own status otherwise, as a shell reports a process's: 128 + N when it was killed by
    signal N (``RankFailure.exit_code`` is then -N), 1 when no status is known."""
    if isinstance(e, ConfigError):
        return 2
    return shell_status(e.exit_code)


@hydra.main(version_base="1.3", config_path="pkg://zeropp.conf", config_name="config")
def _hydra_main(cfg: DictConfig) -> float | None:
    try:
        info = _hydra_info()  # Hydra's record of the overrides resolves their ${...} too
    except OmegaConfBaseException as e:
        from hydra.core.hydra_config import HydraConfig

        typed = cast(list, OmegaConf.to_container(HydraConfig.get().overrides.task, resolve=False))
        print(f"error: {interpolation_error(e, [str(o) for o in typed])}", file=sys.stderr, flush=True)
        sys.exit(2)
    try:
        check_slurm_keys(cast(dict, OmegaConf.to_container(cfg.slurm)), info["launcher"])
        rc = validated(cfg, info["overrides"])
        try:
            summary = execute(rc, info)
        except RunNeverSaved:
            if not info["multirun"] or in_torchrun():
                raise
            # a resumed sweep's point that never ran (nothing saved, no records): finishing the sweep runs it
            print(f"{info['run_dir']}: nothing to resume there (the point never ran); starting it", file=sys.stderr)
            summary = execute(dataclasses.replace(rc, resume=False), info)
    except (ConfigError, RankFailure, DivergenceError) as e:  # DivergenceError: a torchrun rank's own
        if isinstance(e, RunFinished) and info["multirun"] and not in_torchrun():
            # a resumed sweep: this point's run is done; the sweep goes on with its unfinished points
            print(
                f"{info['run_dir']}: finished already; skipped ({str(e).split(': ', 1)[-1].split('. ')[0]})",
                file=sys.stderr,
            )
            return None
        code = command_status(e)
        if not (isinstance(e, (DivergenceError, RunInterrupted)) and os.environ.get("RANK", "0") != "0"):
            print(f"error: {e}", file=sys.stderr, flush=True)  # a diverged or stopped torchrun job: rank 0 says it once
        local_sweep = info["launcher"] in (None, "basic")  # (on a Slurm node the launcher records the job's error)
        if (
            in_torchrun()
            or not info["multirun"]
            or isinstance(e, RunInterrupted)
            or (isinstance(e, RunDirTaken) and local_sweep)
        ):
            sys.exit(code)  # an interrupted sweep, or one landing on earlier runs, stops: no later job runs
        _record_failure(info, str(e), code)  # the sweep's other jobs still run; the command exits non-zero at the end
        return None
    return None if summary is None else float(summary["tokens_per_s"])


@record  # under torchrun: a rank's exception goes to torch's error file
def cli() -> None:
    if in_torchrun() and any(a in ("-m", "--multirun") or a.startswith("sweep=") for a in sys.argv[1:]):
        print(
            "error: multirun/sweeps under torchrun are not supported (every job would re-join the same "
            "rendezvous); run one job per torchrun, or sweep with `python -m experiments.run -m ...` locally",
            file=sys.stderr,
        )
        sys.exit(2)
    try:
        check_overrides(sys.argv[1:])
        check_single_run_values(sys.argv[1:])
        check_fresh_outputs(sys.argv[1:])  # before Hydra writes its .hydra/ files into an earlier run
        check_slurm_launch(sys.argv[1:])  # before Hydra: nothing submitted without the plugin and sbatch
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        with sigterm_raises():  # the launcher installs its own handlers while ranks run
            # the composed output folder is checked whatever the primary config (a user's own too)
            sys.argv = [*sys.argv, REGISTER_OUTPUT_DIR_CHECK]
            _hydra_main()
    except KeyboardInterrupt:  # before any rank started (composing the config): ranks report RunInterrupted
        print("error: interrupted by SIGINT; stopped", file=sys.stderr)
        sys.exit(128 + signal.SIGINT)
    except Terminated:  # likewise (a sweep between its points too)
        print("error: interrupted by SIGTERM; stopped", file=sys.stderr)
        sys.exit(128 + signal.SIGTERM)
    if _failed:
        print(f"error: {len(_failed)} multirun job(s) failed (each directory has {FAILED_FILE}):", file=sys.stderr)
        for job in _failed:
            print(f"  {job['run_dir']}: {' '.join(job['overrides'])}: {job['error'].splitlines()[0]}", file=sys.stderr)
        sys.exit(max(j["exit_code"] for j in _failed))


if __name__ == "__main__":
    cli()
