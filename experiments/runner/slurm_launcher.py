"""``hydra/launcher=slurm``: Hydra's submitit Slurm launcher, reporting failures as the runner does.

The plugin (``hydra-submitit-launcher``) submits one Slurm job per sweep point and runs the
runner's task function there; the runner catches a failed point and writes its ``failed.json``
in that point's directory, on the node. Two things the plugin does not do, and
:func:`launch_recording_failures` adds (called by the launcher class Hydra loads,
``hydra_plugins.zeropp_slurm_launcher``), so that a Slurm sweep ends like a local one:

- the submitting command learns which points failed: it reads each point's ``failed.json`` back
  (written during this sweep) and hands it to the runner's ``note_failed_job``, so the command
  prints the failed points and exits non-zero at the end, as with Hydra's basic launcher;
- a point whose Slurm job ended without a result (cancelled, out of time, node lost, the job
  script failed) does not abort the whole sweep with submitit's exception: it gets a
  ``failed.json`` with submitit's account of it, and the other points' results stay.

Before the one ``sbatch`` call, each point's job is checked (``slurm.check_slurm_job``: one task
on one node, GPUs used); and ``sbatch`` refusing the submission (a partition or account that does
not exist, a time limit above the partition's, no controller reachable) ends the command with
``error:`` and sbatch's own words, exit 2, instead of submitit's traceback: the sweep's points go
in one job array, so nothing was submitted.

Everything else (submission, job arrays, waiting, results) is the plugin's and submitit's. The
plugin's ``launch`` waits with ``submitit.Job.results()`` in one list comprehension, so the first
job without a result would raise out of it; :func:`_results_or_dead` replaces that one method for
the duration of the call (this single-threaded process submits the sweep) rather than copying
the plugin's submission code.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

from hydra.core.utils import JobReturn, JobStatus

from .checks import ConfigError
from .overrides import point_run_dir
from .slurm import check_slurm_job, check_slurm_launch

FAILED_FILE = "failed.json"
"""The runner's per-point failure record (``run.FAILED_FILE``; not imported, see :func:`_runner`)."""


def _runner(task_function: Any) -> Any:
    """The runner module whose task this sweep runs. ``python -m experiments.run`` runs the runner
    as ``__main__``, so importing it by name would give a second copy whose failure list the
    command never reads; the task function's own module is the one that will print and exit."""
    return sys.modules[task_function.__module__]


def _point_config(launcher: Any, overrides: Sequence[str]) -> Any:
    """The composed config of the point of ``overrides``, as its job will compose it."""
    return launcher.hydra_context.config_loader.load_sweep_config(launcher.config, list(overrides))


def _job_dir(cfg: Any, job_num: int) -> Path:
    """The directory Hydra gives point ``job_num`` of config ``cfg`` (``hydra.sweep.dir`` / ``hydra.sweep.subdir``)."""
    return point_run_dir(cfg, job_num, f"job_id_for_{job_num}")  # the job id the plugin sets at submission


def _refuse(message: str) -> NoReturn:
    """End the submitting command before (or instead of) its submission: one ``error:`` line, exit 2."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def submit(launch: Callable[[Sequence[Sequence[str]], int], Sequence[JobReturn]], *args: Any) -> list[JobReturn]:
    """``launch(*args)`` (the plugin's: submit the sweep's job array, wait for every job); ``sbatch``
    refusing the submission is :func:`_refuse`'d with sbatch's message (module docstring)."""
    from submitit.core.utils import FailedJobError

    try:
        return list(launch(*args))
    except FailedJobError as e:  # raised by the submission only: a job's own failure is _results_or_dead's
        said = " / ".join(line.strip() for line in str(e).strip().splitlines()[-4:]) or type(e).__name__
        _refuse(
            f"sbatch refused the sweep's jobs, so none was submitted: {said}. Check slurm.partition, "
            "slurm.time_min, slurm.gpus_per_node and any hydra.launcher.* sbatch option (account, qos) against "
            "the cluster (sinfo lists its partitions), and that its controller answers (squeue)"
        )


def launch_recording_failures(
    launcher: Any,
    launch: Callable[[Sequence[Sequence[str]], int], Sequence[JobReturn]],
    job_overrides: Sequence[Sequence[str]],
    initial_job_idx: int,
) -> Sequence[JobReturn]:
    """Run the plugin's ``launch`` (submit the points, wait for all), then record and count the
    failed points (module docstring). ``launcher``: the plugin's launcher, set up by Hydra."""
    import submitit

    check_slurm_launch(["-m", "hydra/launcher=slurm"])  # sbatch still on PATH (the launcher chosen in a YAML)
    configs = [_point_config(launcher, o) for o in job_overrides]
    try:
        for overrides, cfg in zip(job_overrides, configs):
            check_slurm_job(launcher.params, cfg.launcher.device, " ".join(overrides) if len(configs) > 1 else "")
    except ConfigError as e:
        _refuse(str(e))
    runner = _runner(launcher.task_function)
    dirs = [_job_dir(cfg, initial_job_idx + i) for i, cfg in enumerate(configs)]
    before = {
        d: _stamp(d / FAILED_FILE) for d in dirs
    }  # an older sweep's record in a reused directory is not this one's
    original = submitit.Job.results

    def _results_or_dead(job: Any) -> Any:
        try:
            return original(job)
        except Exception as e:  # submitit's account of a job that ended without a result
            return [_dead_job(job, e)]

    submitit.Job.results = _results_or_dead  # type: ignore[method-assign,assignment]
    try:
        returns = submit(launch, job_overrides, initial_job_idx)
    finally:
        submitit.Job.results = original  # type: ignore[method-assign]
    for i, (overrides, run_dir, ret) in enumerate(zip(job_overrides, dirs, returns)):
        if isinstance(ret, _DeadJob):
            job = {
                "run_dir": str(run_dir),
                "overrides": list(overrides),
                "error": f"Slurm job {ret.job_id} ended without a result: {ret.error}",
                "exit_code": 1,
            }
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / FAILED_FILE).write_text(json.dumps(job, indent=1) + "\n")
            runner.note_failed_job(job)
            returns[i] = _completed(overrides)
            continue
        record = run_dir / FAILED_FILE
        stamp = _stamp(record)
        if stamp is not None and stamp != before[run_dir]:  # written by this sweep's job
            runner.note_failed_job(json.loads(record.read_text()))
    return returns


def _stamp(path: Path) -> tuple[int, int, int] | None:
    """What tells one writing of ``path`` from another (inode, size, mtime; None: no file): compared
    before and after the sweep on this host, so the nodes' clocks do not matter."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


class _DeadJob(JobReturn):
    """Stands for a job submitit has no result of (replaced by a recorded failure in ``launch``)."""

    def __init__(self, job_id: str, error: str) -> None:
        super().__init__()
        self.job_id = job_id
        self.error = error


def _dead_job(job: Any, error: BaseException) -> _DeadJob:
    text = str(error).strip().splitlines()
    return _DeadJob(str(job.job_id), " ".join(line.strip() for line in text[-5:]) or type(error).__name__)


def _completed(overrides: Sequence[str]) -> JobReturn:
    """A point whose failure is recorded: Hydra's sweep goes on (as the runner's own ``None`` return does)."""
    ret = JobReturn(overrides=list(overrides), status=JobStatus.COMPLETED)
    ret.return_value = None
    return ret
