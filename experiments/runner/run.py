"""``python -m experiments.run [overrides]``: the experiment runner (a thin Hydra app).

Composes the config (the schema generated from the library's dataclasses, ``schema.py``, plus
``conf/``), validates it into a :class:`config.RunConfig` before anything starts, then either
launches one process per rank (``launcher.py``) or, under torchrun, runs this process as its rank
(``worker.py``). Outputs land in Hydra's run directory: ``metrics.jsonl``, ``summary.json``,
``ranks/``, ``checkpoints/`` and ``wandb/``. Benchmarks call :func:`run_job` with overrides.

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

import contextlib
import copy
import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence, cast

import hydra
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch.distributed.elastic.multiprocessing.errors import record

from zeropp.comm.layout import LaunchLayout
from zeropp.runtime import checkpoint_files
from zeropp.runtime.divergence import DivergenceError

from ..launch.failure import shell_status
from . import plugins, schema
from .config import (
    ConfigError,
    RunConfig,
    RunDirTaken,
    RunFinished,
    RunNeverSaved,
    from_omegaconf,
    interpolation_error,
    run_records,
    saved_by,
    without_hydra,
)
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
from .overrides import check_fresh_outputs, check_overrides, check_single_run_values, point_run_dir
from .preflight import check_before_launch, check_writable_dir
from .slurm import check_slurm_keys, check_slurm_launch

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


LAYOUT_KEYS = {
    "topology": ("nodes", "ranks_per_node"),
    "topology.nodes": ("nodes",),
    "topology.ranks_per_node": ("ranks_per_node",),
}
"""Overrides that declare the node layout (``topology=2x2`` both fields); under torchrun the fields
not declared come from the launcher."""


def declared_layout(overrides: list[str]) -> set[str]:
    """Which of ``topology.nodes`` / ``topology.ranks_per_node`` the command line sets (Hydra's
    ``key=value``, ``+key=value``, ``++key=value``); ``topology.tp`` alone declares neither."""
    out: set[str] = set()
    for arg in overrides:
        key = arg.split("=", 1)[0].lstrip("+~")
        out.update(LAYOUT_KEYS.get(key, ()))
    return out


def _launch_layout(env: Mapping[str, str] | None) -> LaunchLayout | None:
    """The layout torchrun started (``env``; None: this process's environment when it is a
    torchrun rank, else no layout)."""
    if env is None:
        if not in_torchrun():
            return None
        env = os.environ
    try:
        return LaunchLayout.from_env(env)
    except ValueError as e:
        raise ConfigError(f"invalid launch: {e}") from None


def validated(cfg: DictConfig, overrides: list[str], env: Mapping[str, str] | None = None) -> RunConfig:
    """The composed config validated into a RunConfig (``config.from_omegaconf``). Under torchrun
    (``env``: its environment, None: this process's) the ``topology.nodes`` /
    ``topology.ranks_per_node`` not on the command line are the launcher's nodes and local ranks,
    so every setting is checked against the topology that will run."""
    layout = _launch_layout(env)
    fill = (
        {}
        if layout is None
        else {k: getattr(layout, k) for k in ("nodes", "ranks_per_node") if k not in declared_layout(overrides)}
    )
    if fill:
        cfg = copy.deepcopy(cfg)
        for k, v in fill.items():
            OmegaConf.update(cfg, f"topology.{k}", v)
    try:
        return from_omegaconf(cfg)
    except ConfigError as e:
        if not fill:
            raise
        assert layout is not None
        raise ConfigError(
            f"{e} (with {' '.join(f'topology.{k}={v}' for k, v in fill.items())} from the layout "
            f"torchrun started: {layout.describe()})"
        ) from None


def check_launch(rc: RunConfig, overrides: list[str], env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Under torchrun, before this rank joins anything: the run's topology must be the layout
    torchrun started (ranks numbered node by node, checked by ``LaunchLayout.from_env``); a
    declared one that contradicts it is a ConfigError naming both and the fix, raised on every rank
    alike. Returns what the summary records about the launch."""
    t = rc.topology
    layout = _launch_layout(env)
    if layout is None:  # a launcher that names no node layout: only the world size can be checked
        launched = int((os.environ if env is None else env)["WORLD_SIZE"])
        if launched != rc.world_size:
            raise ConfigError(
                f"invalid config: torchrun started {launched} ranks but topology.nodes x "
                f"topology.ranks_per_node = {t.nodes} x {t.ranks_per_node} = {rc.world_size}; pass "
                "topology.nodes=<nodes> topology.ranks_per_node=<ranks per node> multiplying to "
                f"{launched}"
            )
        return {"cluster": "torchrun"}
    declared = declared_layout(overrides)
    try:
        layout.check(t)
    except ValueError as e:
        drop = " ".join(f"topology.{k}" for k in sorted(declared)) or "topology.*"
        raise ConfigError(
            f"invalid config: {e}; drop {drop} (the launcher's layout is the default) or pass "
            f"topology.nodes={layout.nodes} topology.ranks_per_node={layout.ranks_per_node}. To pose as several nodes "
            "on one host, launch without torchrun: python -m experiments.run topology=<nodes>x<ranks per node>"
        ) from None
    return {
        "cluster": "torchrun",
        "nodes": layout.nodes,
        "ranks_per_node": layout.ranks_per_node,
        "declared": sorted(f"topology.{k}" for k in declared),
    }


def execute(rc: RunConfig, info: dict[str, Any]) -> dict[str, Any] | None:
    """Launch the validated run; rank 0's summary (None on other torchrun ranks)."""
    run_dir = Path(info["run_dir"])
    rc.check_run_dir(run_dir, key=info.get("dir_key") or ("hydra.sweep.dir" if info["multirun"] else "hydra.run.dir"))
    check_before_launch(rc, run_dir, local=not in_torchrun())  # corpus, checkpoint dir, ranks and memory here
    if info["multirun"]:  # this point runs again (resumed, or started in a resumed sweep): an earlier failure
        (run_dir / FAILED_FILE).unlink(missing_ok=True)  # record of it is no longer its outcome (ours: removed)
    if in_torchrun():
        from .worker import run_rank, stopped_status

        if rc.cluster.name == "emulated":
            raise ConfigError(
                "invalid config: cluster=emulated under torchrun; the emulator starts its ranks itself "
                "inside network namespaces: run `python -m experiments.run cluster=emulated ...` "
                "without torchrun"
            )
        placed = check_launch(rc, info["overrides"])  # before this rank joins anything, on every rank
        try:
            summary = run_rank(_spec(rc, info))
        except (Exception, KeyboardInterrupt) as e:  # torchrun's agent stops its ranks with SIGTERM
            code = stopped_status(e)
            if code is None:
                raise
            name = signal.Signals(code - 128).name
            raise RunInterrupted(
                f"interrupted by {name}; stopped; {last_checkpoint(rc, run_dir)}", exit_code=code
            ) from None
        if summary is not None:  # rank 0: record how the ranks were started, as the launcher does
            summary["placement"] = placed
            write_summary(run_dir / "summary.json", summary)
        return summary
    spec = _spec(rc, info)
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


def _spec(rc: RunConfig, info: dict[str, Any]) -> dict[str, Any]:
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


def sweep_point_dir(cfg: DictConfig, num: int) -> Path | None:
    """The run directory of the sweep's point number ``num`` (composed as ``cfg``):
    ``hydra.sweep.dir``/``hydra.sweep.subdir`` resolved with the job number Hydra's launcher gives
    that point; None when it cannot be resolved before the launch (a resolver of the job itself)."""
    try:
        if cfg.hydra.runtime.choices.get("hydra/launcher") not in (None, "basic"):
            subdir = cast(dict, OmegaConf.to_container(cfg.hydra.sweep))["subdir"]  # as typed
            if "hydra.job.id" in str(subdir):
                return None  # another launcher's job id (a Slurm job's) exists only once it is submitted
        return point_run_dir(cfg, num, num)  # the job id as Hydra's basic launcher sets it
    except Exception:  # any resolution error: the job's own check runs again at its start
        return None


RESUME_MAY_CHANGE = (
    "resume",
    "train.steps",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.checkpoint_dir",
)
"""Overrides a resumed sweep point may give other values than the run it continues (to train on,
save differently); ``logger.*``, ``launcher.*`` and ``hydra.*`` too."""


def _override_values(overrides: Sequence[str]) -> dict[str, str]:
    """``key=value`` overrides as key -> value (Hydra's ``+`` / ``++`` prefixes dropped; the value as
    Hydra reads it, so ``3e-3`` and ``0.003`` are one value), less the keys a resumed point may
    change (:data:`RESUME_MAY_CHANGE`; ``logger``, ``launcher``, ``slurm`` and ``hydra`` too: a
    point resumed after its Slurm time limit asks for more time)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    out = {}
    for o in overrides:
        key, eq, value = o.partition("=")
        key = key.lstrip("+")
        if not eq or key in RESUME_MAY_CHANGE or key.split(".")[0] in ("logger", "launcher", "slurm", "hydra"):
            continue
        try:
            out[key] = repr(parser.parse_override(o).value())
        except Exception:  # not Hydra's grammar: compared as typed
            out[key] = value
    return out


def check_resumed_point(run_dir: Path, overrides: Sequence[str]) -> None:
    """A sweep point with ``resume=true`` continues the run in its directory only if that run was
    made by the same point: Hydra names job directories by position (``hydra.sweep.subdir``,
    ``${hydra.job.num}``), so resuming a sweep with other or fewer values maps a point onto another
    point's run (``-m stage=3 resume=true`` over a ``stage=2,3`` sweep continues the stage-2 run as
    stage 3, its records then a mix of both). Refused naming the differing overrides; a run
    continued with other settings on purpose is resumed alone (``hydra.run.dir=<dir> resume=true``)."""
    try:
        earlier = json.loads((run_dir / "ranks" / "spec.json").read_text()).get("overrides")
    except (OSError, ValueError, AttributeError):
        return  # no record of what made it: the point's own checks decide
    if not (isinstance(earlier, list) and all(isinstance(o, str) for o in earlier)):
        return
    before, now = _override_values(earlier), _override_values(overrides)
    differ = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
    if differ:
        was = " ".join(f"{k}={before[k]}" for k in differ if k in before) or "(not set)"
        given = " ".join(f"{k}={now[k]}" for k in differ if k in now) or "(not set)"
        raise ConfigError(
            f"invalid config: resume=true would continue the run in {run_dir}, made with {was}, as this point "
            f"({given}): a sweep's job directories follow its points' order, so other or fewer values map a point "
            "onto another point's run. Resume with the sweep's own values (raise train.steps to train on), use "
            "hydra.sweep.subdir=${hydra.job.override_dirname} for sweeps you will extend, or continue that run "
            "with other settings on purpose alone: hydra.run.dir=<its directory> resume=true"
        )


def check_sweep_points(points: Sequence[tuple[Sequence[str], DictConfig]]) -> None:
    """Every point of a sweep checked before the first starts (``hydra/sweeper=zeropp`` calls this
    with each point's overrides and composed config): its settings validated as the point itself
    will validate them, its Slurm keys, and, with the local launcher, this host's checks (corpus,
    ranks and memory, writable directories) and its own run directory: no two points may share one
    (a constant ``hydra.sweep.subdir``), and a fresh point's must hold no earlier run's records
    (an extended sweep with a custom subdir). Each invalid point is named with its error, then the
    command exits 2 and no point has started."""
    shared = set.intersection(*(set(o) for o, _ in points)) if len(points) > 1 else set()
    bad: list[str] = []
    resumed: list[tuple[RunConfig, Path]] = []  # the resumed points whose directories resolve
    taken: dict[Path, Sequence[str]] = {}  # each point's run directory -> the point that runs there
    for num, (overrides, cfg) in enumerate(points):
        launcher = cfg.hydra.runtime.choices.get("hydra/launcher")
        try:
            check_slurm_keys(cast(dict, OmegaConf.to_container(cfg.slurm)), launcher)
            rc = validated(without_hydra(cfg), list(overrides))
            run_dir = sweep_point_dir(cfg, num)
            if run_dir is not None:
                other = taken.setdefault(run_dir.resolve(), overrides)
                if other is not overrides:
                    subdir = cast(dict, OmegaConf.to_container(cfg.hydra.sweep))["subdir"]  # as typed
                    raise ConfigError(
                        f"invalid config: hydra.sweep.subdir={subdir!r} "
                        f"puts this point into {run_dir}, where point {' '.join(o for o in other if o not in shared)!r} "
                        "runs too (each would overwrite the other's records); make hydra.sweep.subdir differ "
                        "between points: ${hydra.job.num} (the default) or ${hydra.job.override_dirname}"
                    )
            if rc.resume and run_dir is not None:
                check_resumed_point(run_dir, overrides)
                resumed.append((rc, run_dir))
            if launcher in (None, "basic"):
                if run_dir is not None and not rc.resume:
                    # a fresh point landing on an earlier run's records (a resumed sweep's finished points are
                    # skipped and points that never ran are started, each at its turn: RunFinished, RunNeverSaved)
                    rc.check_run_dir(run_dir, key="hydra.sweep.dir")
                check_before_launch(rc, Path(str(cfg.hydra.sweep.dir)), local=True)
        except ConfigError as e:
            own = [o for o in overrides if o not in shared]  # what tells the point from the others
            bad.append(f"  {' '.join(own) or '(no overrides)'}: {e}")
    if not bad and resumed and len(resumed) == len(points) and not any(sweep_point_began(rc, d) for rc, d in resumed):
        sweep_dir = resumed[0][1].parent
        bad.append(
            f"  (every point): resume=true, but no point of this sweep has a checkpoint, records or a start under "
            f"{sweep_dir}: it is not the directory of the sweep to resume (a point that never ran is started "
            f"there only when others of its sweep are found); resume with hydra.sweep.dir=<that sweep's directory>, "
            f"or start this sweep without resume=true"
        )
    if bad:
        print(
            f"error: {len(bad)} of {len(points)} sweep point(s) cannot run; no point was started:\n" + "\n".join(bad),
            file=sys.stderr,
            flush=True,
        )
        sys.exit(2)


FAILED_FILE = "failed.json"
"""Written into a multirun job's directory when that job fails (its overrides and the error)."""


def sweep_point_began(rc: RunConfig, run_dir: Path) -> bool:
    """Whether a sweep point's run began in ``run_dir``: a checkpoint, run records, the launcher's
    rank spec or a failure record is there. A resumed sweep none of whose points began anywhere is
    resumed in the wrong directory (:func:`check_sweep_points`)."""
    return (
        (rc.checkpoint_dir(run_dir) / "LATEST").is_file()
        or bool(run_records(run_dir))
        or (run_dir / "ranks" / "spec.json").is_file()
        or (run_dir / FAILED_FILE).is_file()
    )


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
        _hydra_main()
    except KeyboardInterrupt:  # before any rank started (composing the config): ranks report RunInterrupted
        print("error: interrupted by SIGINT; stopped", file=sys.stderr)
        sys.exit(128 + signal.SIGINT)
    if _failed:
        print(f"error: {len(_failed)} multirun job(s) failed (each directory has {FAILED_FILE}):", file=sys.stderr)
        for job in _failed:
            print(f"  {job['run_dir']}: {' '.join(job['overrides'])}: {job['error'].splitlines()[0]}", file=sys.stderr)
        sys.exit(max(j["exit_code"] for j in _failed))


if __name__ == "__main__":
    cli()
