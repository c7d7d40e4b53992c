"""One job of the runner: a validated config run into its run directory (:func:`execute`), by
the local launcher (one process per rank, ``launcher.py``) or, under torchrun, as this process's
own rank (``worker.py``); :func:`run_job` composes overrides as the command line does and runs
them, for benchmarks and tests. A launched run that diverged is reported with rank 0's message
(:class:`RunDiverged`); an interrupted one names its last checkpoint (:func:`last_checkpoint`).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from pathlib import Path
from typing import Any

from zeropp.runtime import checkpoint_files
from zeropp.runtime.divergence import DivergenceError

from .config import ConfigError, RunConfig, saved_by, without_hydra
from .launch_layout import check_launch, validated
from .launcher import (
    RankFailure,
    RunInterrupted,
    emulated_placement,
    in_torchrun,
    launch,
    local_placement,
    worker_module,
)
from .metrics import read_summary, write_summary
from .overrides import check_overrides
from .preflight import check_before_launch, check_writable_dir

__all__ = ["FAILED_FILE", "RunDiverged", "execute", "job_spec", "last_checkpoint", "recorded_divergence", "run_job"]


def execute(rc: RunConfig, info: dict[str, Any]) -> dict[str, Any] | None:
    """Launch the validated run; rank 0's summary (None on other torchrun ranks)."""
    run_dir = Path(info["run_dir"])
    rc.check_run_dir(run_dir, key=info.get("dir_key") or ("hydra.sweep.dir" if info["multirun"] else "hydra.run.dir"))
    check_before_launch(rc, run_dir, local=not in_torchrun())  # corpus, checkpoint dir, ranks and memory here
    if info["multirun"]:  # this point runs again (resumed, or started in a resumed sweep): an earlier failure
        (run_dir / FAILED_FILE).unlink(missing_ok=True)  # record of it is no longer its outcome (ours: removed)
    if in_torchrun():
        from .worker import raise_own_error, run_rank, stopped_status

        if rc.cluster.name == "emulated":
            raise ConfigError(
                "invalid config: cluster=emulated under torchrun; the emulator starts its ranks itself "
                "inside network namespaces: run `python -m experiments.run cluster=emulated ...` "
                "without torchrun"
            )
        placed = check_launch(rc, info["overrides"])  # before this rank joins anything, on every rank
        try:
            summary = run_rank(job_spec(rc, info))
        except (Exception, KeyboardInterrupt) as e:  # torchrun's agent stops its ranks with SIGTERM
            code = stopped_status(e)
            if code is None:
                raise_own_error(e)  # the rank's own error, also one a stop interrupted while unwinding from it
            name = signal.Signals(code - 128).name
            raise RunInterrupted(
                f"interrupted by {name}; stopped; {last_checkpoint(rc, run_dir)}", exit_code=code
            ) from None
        if summary is not None:  # rank 0: record how the ranks were started, as the launcher does
            summary["placement"] = placed
            write_summary(run_dir / "summary.json", summary)
        return summary
    spec = job_spec(rc, info)
    label = spec["label"]
    t = rc.topology
    placement = (
        emulated_placement(
            t.world_size,
            t.ranks_per_node,
            rc.cluster.inter_gbps,
            rc.cluster.inter_latency_ms,
            device=rc.launcher.device,
        )
        if rc.cluster.name == "emulated"
        else local_placement(t.world_size)
    )
    print(f"zeropp: {label} -> {run_dir}", file=sys.stderr, flush=True)
    started = time.time_ns()
    try:
        placed = launch(
            module=worker_module(__package__),
            spec=spec,
            run_dir=run_dir,
            world_size=t.world_size,
            ranks_per_node=t.ranks_per_node,
            placement_cm=placement,
            timeout_s=rc.launcher.timeout_s,
            grace_s=rc.launcher.grace_s,
            heartbeat_s=rc.launcher.heartbeat_s,
        )
    except RunInterrupted as e:
        raise RunInterrupted(f"{e}; {last_checkpoint(rc, run_dir)}", exit_code=e.exit_code) from None
    except RankFailure:
        diverged = recorded_divergence(run_dir / "summary.json", started)
        if diverged is None:
            raise
        raise diverged from None  # every rank stopped on purpose: rank 0's message, not the first exit seen
    summary = read_summary(run_dir / "summary.json")
    summary["placement"] = placed  # e.g. the emulated links' configured and measured rates
    write_summary(run_dir / "summary.json", summary)
    return summary


def last_checkpoint(rc: RunConfig, run_dir: Path) -> str:
    """Where an interrupted run can be continued from, for its one ``error:`` line: the newest
    checkpoint this run saved (``checkpoint_files.latest``; one another run saved into a shared
    ``train.checkpoint_dir`` is not this run's) and how to resume it, or that it saved none."""
    ckpt = rc.checkpoint_dir(run_dir)
    with contextlib.suppress(OSError, ValueError):
        newest = checkpoint_files.latest(ckpt)
        step = checkpoint_files.version_step(newest.name)
        if saved_by(newest) in (None, str(run_dir.resolve())):
            return f"last checkpoint: step {step} in {newest} (resume=true in the same run directory continues it)"
    if rc.train.checkpoint_every <= 0:
        return "no checkpoint (train.checkpoint_every=0)"
    return f"no checkpoint saved yet (train.checkpoint_every={rc.train.checkpoint_every})"


class RunDiverged(RankFailure):
    """A launched run stopped because training diverged: every rank agreed and stopped at the same
    step (``zeropp.runtime.divergence``). The message is rank 0's, ``exit_code`` is
    ``DivergenceError.exit_code`` (3) and ``divergence`` the error itself (step, loss, norm). A
    :class:`RankFailure`, so a sweep that records failed runs records this one too."""

    def __init__(self, divergence: DivergenceError) -> None:
        super().__init__(str(divergence), rank=0, exit_code=divergence.exit_code)
        self.divergence = divergence


def recorded_divergence(path: Path, since_ns: int) -> RunDiverged | None:
    """The divergence rank 0 recorded in ``path`` if this launch (started at ``since_ns``) wrote
    it with ``"status": "diverged"``; None otherwise (no summary, an older run's, or another outcome)."""
    try:
        if path.stat().st_mtime_ns < since_ns:
            return None
        summary = read_summary(path)
    except (OSError, ValueError):
        return None
    if summary.get("status") != "diverged" or not isinstance(summary.get("divergence"), dict):
        return None
    return RunDiverged(DivergenceError.from_record(summary["divergence"]))


def job_spec(rc: RunConfig, info: dict[str, Any]) -> dict[str, Any]:
    """What every rank is given: the validated config and where and under what name it runs."""
    return {
        "config": rc.to_dict(),
        "run_dir": info["run_dir"],
        "name": info["name"],
        "group": info["group"],
        "overrides": info["overrides"],
        "label": rc.describe(info["model_name"]),
        "model_name": info["model_name"],
    }


def run_job(overrides: list[str], run_dir: str | Path, *, dir_key: str = "run_dir") -> dict[str, Any]:
    """Compose ``overrides`` like the command line, run the job into ``run_dir``, return its
    summary. For benchmarks and tests that run several jobs from Python; raises ConfigError or
    RankFailure (:class:`RunDiverged` for a diverged run) as the command would. ``dir_key``: what
    the caller's user sets to choose ``run_dir`` (a tool's ``--out``), named when ``run_dir``
    already holds a run and this one is fresh."""
    from hydra import compose, initialize_config_module

    check_overrides(overrides)
    with initialize_config_module("zeropp.conf", version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    info = {
        "run_dir": str(run_dir),
        "overrides": list(overrides),
        "name": ",".join(overrides) or "defaults",
        "group": None,
        "multirun": False,
        "model_name": cfg.hydra.runtime.choices.get("model") or "",
        "dir_key": dir_key,
    }
    rc = validated(without_hydra(cfg), list(overrides))
    check_writable_dir(dir_key, Path(run_dir))  # under a file, or unwritable: a ConfigError naming it
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    summary = execute(rc, info)
    assert summary is not None
    return summary


FAILED_FILE = "failed.json"
"""Written into a multirun job's directory when that job fails (its overrides and the error)."""
