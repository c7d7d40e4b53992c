"""A sweep checked before its first point starts (``hydra/sweeper=zeropp`` hands every composed
point to :func:`check_sweep_points`): each point's settings, Slurm keys, this host's checks and
its own run directory; that its ``hydra.sweep.dir`` holds no other sweep (:func:`other_sweep_in`);
and, resumed (``resume=true``), that each point continues its own run
(:func:`check_resumed_point`) in a sweep that began there (:func:`sweep_point_began`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Sequence, cast

from omegaconf import DictConfig, OmegaConf

from .config import ConfigError, RunConfig, run_records, without_hydra
from .job import FAILED_FILE
from .launch_layout import validated
from .overrides import point_run_dir
from .preflight import check_before_launch
from .slurm import check_slurm_keys

__all__ = [
    "RESUME_MAY_CHANGE",
    "SWEEP_RECORD",
    "check_resumed_point",
    "check_sweep_points",
    "other_sweep_in",
    "sweep_point_began",
    "sweep_point_dir",
]

SWEEP_RECORD = "multirun.yaml"
"""The sweep's config, which Hydra's sweeper writes into ``hydra.sweep.dir`` (over any earlier one)."""


def _typed_subdir(cfg: DictConfig) -> object:
    """``hydra.sweep.subdir`` as typed (its ``${...}`` unresolved, as the sweep record keeps it)."""
    return cast(dict, OmegaConf.to_container(cfg.hydra.sweep))["subdir"]


def sweep_point_dir(cfg: DictConfig, num: int) -> Path | None:
    """The run directory of the sweep's point number ``num`` (composed as ``cfg``):
    ``hydra.sweep.dir``/``hydra.sweep.subdir`` resolved with the job number Hydra's launcher gives
    that point; None when it cannot be resolved before the launch (a resolver of the job itself)."""
    try:
        if cfg.hydra.runtime.choices.get("hydra/launcher") not in (None, "basic"):
            if "hydra.job.id" in str(_typed_subdir(cfg)):
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
    if points and (elsewhere := other_sweep_in(points[0][1])) is not None:
        bad.append(f"  (every point): {elsewhere}")
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
                    raise ConfigError(
                        f"invalid config: hydra.sweep.subdir={_typed_subdir(cfg)!r} "
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


def other_sweep_in(cfg: DictConfig) -> str | None:
    """Why this sweep (composed as ``cfg``) must not run in its ``hydra.sweep.dir``, or None: the
    directory's :data:`SWEEP_RECORD` is another sweep's, one with another ``hydra.sweep.subdir``.
    Its points would land beside that sweep's, Hydra would write this sweep's record over that
    one, and whatever reads the directory as one sweep (``experiments.report``, the wandb group,
    a resume) would mix the two. The same subdir is the same sweep resumed or extended (each
    point's own directory is checked apart); a record without a readable subdir is not judged."""
    sweep_dir = Path(str(cfg.hydra.sweep.dir))
    try:  # OmegaConf's loader is YAML's safe one: the file builds plain data, never objects
        record = OmegaConf.to_container(OmegaConf.load(sweep_dir / SWEEP_RECORD), resolve=False)
        earlier = cast(dict, record)["hydra"]["sweep"]["subdir"]
    except Exception:  # no record, or none of a sweep (unreadable, not a mapping, no subdir): not judged
        return None
    subdir = _typed_subdir(cfg)
    if not isinstance(earlier, str) or earlier == subdir:
        return None
    return (
        f"invalid config: hydra.sweep.dir={sweep_dir} holds another sweep (its {SWEEP_RECORD} has "
        f"hydra.sweep.subdir={earlier!r}, this sweep {subdir!r}): its points would run beside that sweep's, "
        f"its {SWEEP_RECORD} would replace that sweep's, and a report of the directory would mix both; give "
        f"this sweep a directory of its own (hydra.sweep.dir={sweep_dir.parent / (sweep_dir.name + '-2')}), or pass "
        f"hydra.sweep.subdir={earlier!r} to resume or extend that sweep"
    )


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
