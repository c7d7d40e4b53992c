"""``tests.experiment_helpers.run_cli_here``, the runner's command line in the test process that
the end-to-end tests use instead of a runner interpreter: it gives what ``subprocess.run`` gives
(exit status, stdout, stderr), scrubs and restores the environment, starts each command with no
failed multirun job of an earlier one, and stops a command that runs past its timeout (the
test fails with that). The launch
is replaced here (the real one is the end-to-end tier's)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

import zeropp.experiments.runner.job as runner_job
import zeropp.experiments.runner.run as run
from tests.experiment_helpers import MINI_1X2_CPU, RunnerTimeout, run_cli_here
from zeropp.experiments.launch import RankFailure
from zeropp.experiments.runner.config import ConfigError


def test_the_launch_sees_the_scrubbed_environment_and_its_failure_is_the_exit_status(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, str | None] = {}

    def failing_launch(**_: object) -> dict:
        seen.update(fault=os.environ.get("ZEROPP_INJECT_FAULT"), extra=os.environ.get("ZPP_TEST_EXTRA"))
        print("a rank's line")
        raise RankFailure("rank 1 exited with code 7", rank=1, exit_code=7)

    monkeypatch.setattr(runner_job, "launch", failing_launch)
    monkeypatch.setenv("ZEROPP_INJECT_FAULT", "raise@0:1")  # inherited from the test: not the command's
    p = run_cli_here([*MINI_1X2_CPU, f"hydra.run.dir={tmp_path}"], capfd, env={"ZPP_TEST_EXTRA": "1"}, timeout=120)
    assert p.returncode == 7 and "error: rank 1 exited with code 7" in p.stderr, p.stderr[-2000:]
    assert "a rank's line" in p.stdout
    assert seen == {"fault": None, "extra": "1"}
    assert os.environ["ZEROPP_INJECT_FAULT"] == "raise@0:1" and "ZPP_TEST_EXTRA" not in os.environ  # restored


def test_a_command_past_its_timeout_is_stopped_and_reported(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def stuck_launch(**_: object) -> dict:
        time.sleep(300)
        raise AssertionError("the timeout did not stop the command")

    monkeypatch.setattr(runner_job, "launch", stuck_launch)
    handler = signal.getsignal(signal.SIGALRM)
    with pytest.raises(RunnerTimeout, match="ran past run_cli_here's timeout of 3 s"):
        run_cli_here([*MINI_1X2_CPU, f"hydra.run.dir={tmp_path}"], capfd, timeout=3)
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0) and signal.getsignal(signal.SIGALRM) is handler


def test_exit_status_of_a_refused_config_and_a_fresh_failure_list(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    run._failed.append({"run_dir": "x", "overrides": [], "error": "an earlier command's", "exit_code": 9})
    try:
        p = run_cli_here([*MINI_1X2_CPU, "stage=7", f"hydra.run.dir={tmp_path}"], capfd, timeout=120)
    finally:
        run._failed.pop()
    assert p.returncode == 2 and "error: " in p.stderr and "stage" in p.stderr, p.stderr
    assert "an earlier command's" not in p.stderr and not (tmp_path / "ranks").exists()


@pytest.mark.parametrize(
    "code, status", [(-signal.SIGKILL, 128 + signal.SIGKILL), (-signal.SIGSEGV, 128 + signal.SIGSEGV), (None, 1)]
)
def test_a_rank_killed_by_a_signal_gives_the_shells_status(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, code: int | None, status: int
) -> None:
    """A rank killed by signal N makes the command exit with 128 + N (docs/reliability.md), as a shell
    reports the killed process itself; a failure without a known status exits 1."""

    def killed_launch(**_: object) -> dict:
        raise RankFailure("rank 1 was killed", rank=1, exit_code=code)

    monkeypatch.setattr(runner_job, "launch", killed_launch)
    p = run_cli_here([*MINI_1X2_CPU, f"hydra.run.dir={tmp_path}"], capfd, timeout=120)
    assert p.returncode == status, p.stderr[-2000:]


def _launch_recorder(calls: list[int]):
    def fake_launch(**_: object) -> dict:
        calls.append(1)
        raise RankFailure("rank 0 exited with code 5", rank=0, exit_code=5)

    return fake_launch


@pytest.mark.parametrize("held", ["summary.json", "metrics.jsonl"])
def test_a_fresh_run_does_not_land_on_an_earlier_runs_records(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, held: str
) -> None:
    """Without resume=true a run into a directory holding a run's summary or metrics is refused
    before Hydra writes anything there (no .hydra/) and before any rank starts; resume=true is
    offered once that run has a checkpoint, and with it the run goes on to the launch."""
    calls: list[int] = []
    monkeypatch.setattr(runner_job, "launch", _launch_recorder(calls))
    path = tmp_path / held
    path.write_text('{"step": 1}\n')
    before = path.read_bytes()
    args = [*MINI_1X2_CPU, "train.checkpoint_every=1", f"hydra.run.dir={tmp_path}"]
    p = run_cli_here(args, capfd, timeout=120)
    assert p.returncode == 2 and "already holds a run" in p.stderr and "hydra.run.dir" in p.stderr, p.stderr[-2000:]
    assert "resume=true" not in p.stderr  # no checkpoint to resume from
    assert calls == [] and path.read_bytes() == before and sorted(tmp_path.iterdir()) == [path]
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "LATEST").write_text("ckpt-00000006\n")
    p = run_cli_here(args, capfd, timeout=120)
    assert p.returncode == 2 and "pass resume=true to continue it" in p.stderr, p.stderr[-2000:]
    p = run_cli_here([*args, "resume=true"], capfd, timeout=120)
    assert calls == [1] and p.returncode == 5, p.stderr[-2000:]


def test_a_sweep_into_earlier_runs_stops_before_its_first_job(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep whose hydra.sweep.dir holds an earlier sweep's finished job is refused as a whole
    (exit 2, naming hydra.sweep.dir) before any job runs; no failed.json is written into that job."""
    calls: list[int] = []
    monkeypatch.setattr(runner_job, "launch", _launch_recorder(calls))
    (tmp_path / "0").mkdir()
    (tmp_path / "0" / "summary.json").write_text("{}")
    p = run_cli_here(["-m", *MINI_1X2_CPU, "train.seed=1,2", f"hydra.sweep.dir={tmp_path}"], capfd, timeout=120)
    assert p.returncode == 2 and "already holds a run" in p.stderr and "hydra.sweep.dir" in p.stderr, p.stderr
    assert calls == [] and sorted(x.name for x in tmp_path.rglob("*")) == ["0", "summary.json"]


def test_a_second_sweep_with_another_subdir_in_the_same_sweep_dir_is_refused(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two sweeps into one ``hydra.sweep.dir`` with different ``hydra.sweep.subdir``: the second
    would run its points beside the first's and write its ``multirun.yaml`` over the first's (a
    report of the directory then mixes both). Refused before any point, naming what to change,
    the first sweep's record as it was; the same subdir (the sweep extended) and a directory of
    its own still run."""
    calls: list[int] = []
    monkeypatch.setattr(runner_job, "launch", _launch_recorder(calls))
    sweep = tmp_path / "sweep"
    first = ["-m", *MINI_1X2_CPU, "train.seed=1,2", f"hydra.sweep.dir={sweep}", "hydra.sweep.subdir=seed${train.seed}"]
    assert run_cli_here(first, capfd).returncode == 5 and calls == [1, 1]  # (the recorder's failure)
    record = (sweep / "multirun.yaml").read_bytes()
    second = ["-m", *MINI_1X2_CPU, "train.seed=3,4", "hydra.sweep.subdir=other${train.seed}"]
    p = run_cli_here([*second, f"hydra.sweep.dir={sweep}"], capfd)
    assert p.returncode == 2 and "2 sweep point(s) cannot run; no point was started" in p.stderr, p.stderr[-2000:]
    assert (
        f"(every point): invalid config: hydra.sweep.dir={sweep} holds another sweep (its multirun.yaml has "
        "hydra.sweep.subdir='seed${train.seed}', this sweep 'other${train.seed}')" in p.stderr
    ), p.stderr[-2000:]
    assert f"hydra.sweep.dir={tmp_path / 'sweep-2'}), or pass hydra.sweep.subdir='seed${{train.seed}}'" in p.stderr
    assert calls == [1, 1] and (sweep / "multirun.yaml").read_bytes() == record
    assert sorted(d.name for d in sweep.iterdir()) == ["multirun.yaml", "seed1", "seed2"]
    assert run_cli_here([*second, f"hydra.sweep.dir={tmp_path / 'sweep-2'}"], capfd).returncode == 5  # its own dir
    extended = [*first[:-3], "train.seed=3", f"hydra.sweep.dir={sweep}", first[-1]]
    assert run_cli_here(extended, capfd).returncode == 5 and calls == [1, 1, 1, 1, 1]


def test_a_sweep_with_an_invalid_later_point_starts_no_point(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every point of a sweep is checked before the first starts (``hydra/sweeper=zeropp``): a
    bucket size only the third point gets is named with its point; exit 2, no job directory, no
    launch (before, the first two points ran)."""
    calls: list[int] = []
    monkeypatch.setattr(runner_job, "launch", _launch_recorder(calls))
    sweep = tmp_path / "sweep"
    args = ["-m", *MINI_1X2_CPU, "zero.reduce_bucket_size=1000,2000,-5", f"hydra.sweep.dir={sweep}"]
    p = run_cli_here(args, capfd, timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "1 of 3 sweep point(s) cannot run; no point was started" in p.stderr, p.stderr[-2000:]
    assert "zero.reduce_bucket_size=-5: invalid config" in p.stderr and "reduce_bucket_size must be >= 1" in p.stderr
    assert "\n  zero.reduce_bucket_size=-5: invalid config" in p.stderr  # only what sets the point apart
    assert calls == [] and not sweep.exists()  # checked before Hydra makes the sweep directory
    p = run_cli_here([*args, "hydra.sweeper.max_batch_size=1"], capfd, timeout=120)  # batches of one: all checked first
    assert p.returncode == 2 and "1 of 3 sweep point(s) cannot run" in p.stderr, p.stderr[-2000:]
    assert calls == [] and not sweep.exists()
    p = run_cli_here(["-m", *MINI_1X2_CPU, "zero.reduce_bucket_size=1000,2000", f"hydra.sweep.dir={sweep}"], capfd)
    assert p.returncode == 5 and calls == [1, 1], p.stderr[-2000:]  # valid points run as before


def test_an_empty_metrics_file_or_unused_checkpoints_do_not_block_a_fresh_run(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An empty metrics.jsonl (a run stopped before its first step) is no record, and checkpoints
    alone do not block a run (a train.checkpoint_dir may be shared by several runs on purpose)."""
    calls: list[int] = []
    monkeypatch.setattr(runner_job, "launch", _launch_recorder(calls))
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "LATEST").write_text("ckpt-00000006\n")
    p = run_cli_here([*MINI_1X2_CPU, "train.checkpoint_every=1", f"hydra.run.dir={tmp_path}"], capfd, timeout=120)
    assert calls == [1] and p.returncode == 5, p.stderr[-2000:]


@pytest.mark.parametrize("spelling", ["resume=yes", "resume=True", "++resume=1"])
def test_every_spelling_of_resume_true_passes_the_check_before_hydra(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, spelling: str
) -> None:
    calls: list[int] = []
    monkeypatch.setattr(runner_job, "launch", _launch_recorder(calls))
    (tmp_path / "summary.json").write_text("{}")
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "LATEST").write_text("ckpt-00000006\n")
    p = run_cli_here([*MINI_1X2_CPU, spelling, f"hydra.run.dir={tmp_path}"], capfd, timeout=120)
    assert calls == [1] and p.returncode == 5, p.stderr[-2000:]


def test_a_sweep_adding_points_under_its_own_subdirs_is_not_refused(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a custom hydra.sweep.subdir the job directories are not the numbered ones: an earlier
    point's finished run (stage=2) does not stop new points (stage=3), which land elsewhere."""
    calls: list[int] = []
    monkeypatch.setattr(runner_job, "launch", _launch_recorder(calls))
    (tmp_path / "stage=2").mkdir()
    (tmp_path / "stage=2" / "summary.json").write_text("{}")
    args = [
        "-m",
        *MINI_1X2_CPU,
        "stage=3",
        f"hydra.sweep.dir={tmp_path}",
        "hydra.sweep.subdir=${hydra.job.override_dirname}",
    ]
    p = run_cli_here(args, capfd, timeout=120)
    assert calls == [1], p.stderr[-2000:]


def test_run_job_into_a_directory_under_a_file_is_a_config_error(tmp_path: Path) -> None:
    """``run_job``'s ``run_dir`` below a file (a tool's ``--out`` mistyped): a ConfigError naming the
    caller's key, before anything starts (before: ``NotADirectoryError`` from its mkdir)."""
    (tmp_path / "file").write_text("x")
    with pytest.raises(run.ConfigError, match=r"--out='.*file/run' cannot be created: .*file is not a directory"):
        run.run_job([*MINI_1X2_CPU], tmp_path / "file" / "run", dir_key="--out")


def test_sweep_points_sharing_a_run_dir_or_landing_on_earlier_runs_start_no_point(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each point's own run directory (``hydra.sweep.subdir`` resolved with its job number) is
    checked with the others, before the first starts: a constant subdir puts two points into one
    directory, and a sweep extended with a custom subdir meets an earlier run's records. Exit 2
    naming the points, nothing launched (before, the first point ran, then the sweep stopped)."""
    calls: list[int] = []
    monkeypatch.setattr(runner_job, "launch", _launch_recorder(calls))
    sweep = tmp_path / "sweep"
    p = run_cli_here(
        ["-m", *MINI_1X2_CPU, "train.seed=1,2", f"hydra.sweep.dir={sweep}", "hydra.sweep.subdir=same"], capfd
    )
    assert p.returncode == 2 and "1 of 2 sweep point(s) cannot run; no point was started" in p.stderr, p.stderr[-2000:]
    assert "train.seed=2: invalid config: hydra.sweep.subdir='same'" in p.stderr and "'train.seed=1'" in p.stderr
    assert calls == [] and not (sweep / "same").exists()
    subdir = "hydra.sweep.subdir=seed${train.seed}"
    (sweep / "seed2").mkdir(parents=True)
    (sweep / "seed2" / "summary.json").write_text("{}")
    p = run_cli_here(["-m", *MINI_1X2_CPU, "train.seed=1,2", f"hydra.sweep.dir={sweep}", subdir], capfd)
    assert p.returncode == 2 and "1 of 2 sweep point(s) cannot run" in p.stderr, p.stderr[-2000:]
    assert f"train.seed=2: invalid config: {sweep / 'seed2'} already holds a run" in p.stderr
    assert calls == [] and not (sweep / "seed1").exists()
    (sweep / "multirun.yaml").write_text("the earlier sweep's record\n")
    p = run_cli_here(["-m", *MINI_1X2_CPU, "train.seed=1,2", f"hydra.sweep.dir={sweep}", subdir], capfd)
    assert p.returncode == 2 and (sweep / "multirun.yaml").read_text() == "the earlier sweep's record\n"
    p = run_cli_here(["-m", *MINI_1X2_CPU, "train.seed=1,3", f"hydra.sweep.dir={sweep}", subdir], capfd)
    assert p.returncode == 5 and calls == [1, 1], p.stderr[-2000:]  # distinct, fresh directories run as before


def test_a_sweep_with_an_interpolation_naming_no_key_starts_no_point(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``key=${typo}`` in a sweep is each point's one ``invalid config`` line naming the key, exit 2
    before any starts (before: OmegaConf's InterpolationKeyError traceback from the sweeper, exit 1)."""
    calls: list[int] = []
    monkeypatch.setattr(runner_job, "launch", _launch_recorder(calls))
    args = ["-m", *MINI_1X2_CPU, "train.seed=1,2", "zero.reduce_bucket_size=${zero.nope}"]
    p = run_cli_here([*args, f"hydra.sweep.dir={tmp_path / 'sweep'}"], capfd)
    assert p.returncode == 2 and "2 of 2 sweep point(s) cannot run" in p.stderr, p.stderr[-2000:]
    assert "zero.reduce_bucket_size: Interpolation key 'zero.nope' not found" in p.stderr and calls == []


def test_a_resume_from_a_shared_checkpoint_dir_refuses_another_runs_newest(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sweep points sharing one ``train.checkpoint_dir``: resuming point a, whose own checkpoints
    are there but whose ``LATEST`` is point b's, is refused before any rank starts, naming both
    (before: a loaded b's weights and trained on under a's name, with only a warning about changed
    settings). Point b resumes its own newest; a fresh directory resuming from them (a fork) too."""
    import json

    calls: list[int] = []
    monkeypatch.setattr(runner_job, "launch", _launch_recorder(calls))
    ckpt, a, b = tmp_path / "ck", tmp_path / "sweep" / "0", tmp_path / "sweep" / "1"
    for name, by in (("ckpt-00000002-00000000000000aa", a), ("ckpt-00000002-00000000000000bb", b)):
        (ckpt / name).mkdir(parents=True)
        meta = {"format": 3, "files": {}, "step": 2, "extra": {"step": 2, "run_dir": str(by.resolve())}}
        (ckpt / name / "meta.json").write_text(json.dumps(meta))
    (ckpt / "LATEST").write_text("ckpt-00000002-00000000000000bb\n")
    common = [*MINI_1X2_CPU, "train.steps=4", "train.checkpoint_every=2", f"train.checkpoint_dir={ckpt}", "resume=true"]
    p = run_cli_here([*common, f"hydra.run.dir={a}"], capfd)
    assert p.returncode == 2 and calls == [], p.stderr[-2000:]
    assert f"was saved by the run in {b.resolve()}, not by this run ({a.resolve()}" in p.stderr
    assert "whose newest there is ckpt-00000002-00000000000000aa" in p.stderr
    p = run_cli_here([*common, f"hydra.run.dir={b}"], capfd)
    assert p.returncode == 5 and calls == [1], p.stderr[-2000:]
    p = run_cli_here([*common, f"hydra.run.dir={tmp_path / 'fork'}"], capfd)
    assert p.returncode == 5 and calls == [1, 1], p.stderr[-2000:]


def test_a_run_moved_back_and_forth_resumes_from_its_own_checkpoint_folder(tmp_path: Path) -> None:
    """The recorded saver is compared only for a checkpoint folder outside the run directory (one
    that can be shared): the default ``<run dir>/checkpoints`` is the run's own, whatever path its
    directory had when each version was saved (a run copied between hosts, a container's mount)."""
    import json

    from zeropp.experiments.runner.config import check_resumes_its_own

    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints"
    for name, by in (("ckpt-00000002-00000000000000aa", run_dir), ("ckpt-00000004-00000000000000bb", "/mnt/run")):
        (ckpt / name).mkdir(parents=True)
        meta = {"format": 3, "files": {}, "step": 2, "extra": {"step": 2, "run_dir": str(by)}}
        (ckpt / name / "meta.json").write_text(json.dumps(meta))
    (ckpt / "LATEST").write_text("ckpt-00000004-00000000000000bb\n")
    check_resumes_its_own(ckpt, run_dir)  # before: refused, "saved by the run in /mnt/run"
    shared = tmp_path / "shared"
    ckpt.rename(shared)
    with pytest.raises(ConfigError, match="saved by the run in /mnt/run"):
        check_resumes_its_own(shared, run_dir)


@pytest.mark.parametrize("size", ["0", "-1"])
def test_a_sweep_batch_size_below_one_is_refused_before_any_point(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, size: str
) -> None:
    """``hydra.sweeper.max_batch_size`` below 1 is one error line and exit 2, nothing launched and
    no sweep directory (before: the AssertionError traceback of Hydra's basic sweeper, exit 1)."""
    calls: list[int] = []
    monkeypatch.setattr(runner_job, "launch", _launch_recorder(calls))
    sweep = tmp_path / "sweep"
    args = ["-m", *MINI_1X2_CPU, "train.seed=1,2", f"hydra.sweep.dir={sweep}", f"hydra.sweeper.max_batch_size={size}"]
    p = run_cli_here(args, capfd)
    assert p.returncode == 2 and f"hydra.sweeper.max_batch_size={size}; allowed:" in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr and calls == [] and not sweep.exists()


def test_resuming_a_sweep_with_other_values_refuses_to_map_a_point_onto_another_points_run(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Job directories follow the points' order: ``-m train.seed=2 resume=true`` over a
    ``train.seed=1,2`` sweep would continue job 0, seed 1's run, as seed 2. Refused before any
    point starts, naming both values (before: it resumed, its records a mix of both points). The
    sweep's own values, with a longer run, resume as before."""
    import json

    calls: list[int] = []
    monkeypatch.setattr(runner_job, "launch", _launch_recorder(calls))
    sweep = tmp_path / "sweep"
    for job, seed in ((0, 1), (1, 2)):
        (sweep / str(job) / "ranks").mkdir(parents=True)
        spec = {"overrides": [*MINI_1X2_CPU, f"train.seed={seed}", "train.steps=4", "train.checkpoint_every=2"]}
        (sweep / str(job) / "ranks" / "spec.json").write_text(json.dumps(spec))
        (sweep / str(job) / "checkpoints").mkdir()
        (sweep / str(job) / "checkpoints" / "LATEST").write_text("ckpt-00000004-0000000000000000\n")
    args = ["-m", *MINI_1X2_CPU, "train.steps=8", "train.checkpoint_every=2", "resume=true", f"hydra.sweep.dir={sweep}"]
    p = run_cli_here([*args, "train.seed=2"], capfd)
    assert p.returncode == 2 and calls == [], p.stderr[-2000:]
    assert f"would continue the run in {sweep / '0'}, made with train.seed=1, as this point (train.seed=2)" in p.stderr
    p = run_cli_here([*args, "train.seed=1,2"], capfd)
    assert p.returncode == 5 and calls == [1, 1], p.stderr[-2000:]
    # the same values spelled otherwise, and more Slurm time (why a sweep is resumed), still resume
    spec_path = sweep / "0" / "ranks" / "spec.json"
    earlier = json.loads(spec_path.read_text())["overrides"]
    spec_path.write_text(json.dumps({"overrides": [*earlier, "optim.lr=0.003", "slurm.time_min=60"]}))
    run.check_resumed_point(sweep / "0", [*earlier, "optim.lr=3e-3", "slurm.time_min=240", "resume=true"])
    with pytest.raises(ConfigError, match="made with optim.lr=0.003"):
        run.check_resumed_point(sweep / "0", [*earlier, "optim.lr=1e-3", "slurm.time_min=240"])


def test_a_resumed_sweep_resumes_skips_or_starts_each_point_at_its_turn(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interrupted sweep resumed: the point with a checkpoint is launched to resume; the point
    that never started (no checkpoint, no records) is started fresh at its turn; a finished point
    is skipped (no failure recorded in its run's directory); a point that ran but saved nothing
    (its records there, no checkpoint) fails alone, its records untouched. Before: the never-started
    point failed too, so a resumed sweep could not finish."""
    import json

    resumed: list[bool] = []

    def fake_launch(**kw: object) -> dict:
        resumed.append(kw["spec"]["config"]["resume"])  # type: ignore[index]
        assert not (Path(str(kw["run_dir"])) / "failed.json").exists()  # the earlier failure's record is gone
        raise RankFailure("rank 0 exited with code 5", rank=0, exit_code=5)

    monkeypatch.setattr(runner_job, "launch", fake_launch)
    sweep = tmp_path / "sweep"
    (sweep / "0" / "ranks").mkdir(parents=True)
    spec = {"overrides": [*MINI_1X2_CPU, "train.seed=1", "train.steps=4", "train.checkpoint_every=2"]}
    (sweep / "0" / "ranks" / "spec.json").write_text(json.dumps(spec))
    (sweep / "0" / "checkpoints").mkdir()
    (sweep / "0" / "checkpoints" / "LATEST").write_text("ckpt-00000002-0000000000000000\n")
    (sweep / "2" / "checkpoints" / "ckpt-00000004-0000000000000000").mkdir(parents=True)  # point 2 finished
    (sweep / "2" / "checkpoints" / "LATEST").write_text("ckpt-00000004-0000000000000000\n")
    (sweep / "1").mkdir()
    (sweep / "1" / "failed.json").write_text('{"error": "crashed at start-up"}\n')  # point 1 never ran
    (sweep / "3").mkdir()
    (sweep / "3" / "metrics.jsonl").write_text('{"step": 1}\n')  # point 3 ran, saved nothing
    args = ["-m", *MINI_1X2_CPU, "train.steps=4", "train.checkpoint_every=2", "resume=true", "train.seed=1,2,3,4"]
    p = run_cli_here([*args, f"hydra.sweep.dir={sweep}"], capfd)
    assert resumed == [True, False], p.stderr[-2000:]  # point 0 resumed, point 1 started fresh
    assert f"{sweep / '1'}: nothing to resume there (the point never ran); starting it" in p.stderr
    assert "rank 0 exited with code 5" in (sweep / "1" / "failed.json").read_text()  # (the fake launch's)
    assert f"{sweep / '2'}: finished already; skipped" in p.stderr and not (sweep / "2" / "failed.json").exists()
    assert "resume=true but there is no checkpoint under" in (sweep / "3" / "failed.json").read_text()
    assert (sweep / "3" / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_a_command_line_value_that_replaces_a_sweep_presets_axis_is_named(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``sweep=ablation quant=hpz``: Hydra lets the command line win, so the preset's five-point
    quant axis becomes one point. That runs, and one line says so (before: the sweep just ran one
    point); the preset alone, or a key it does not sweep, prints no such line."""
    calls: list[int] = []
    monkeypatch.setattr(runner_job, "launch", _launch_recorder(calls))
    p = run_cli_here(["sweep=ablation", "quant=hpz", *MINI_1X2_CPU, f"hydra.sweep.dir={tmp_path / 'a'}"], capfd)
    assert calls == [1], p.stderr[-2000:]
    assert "zeropp: quant=hpz replaces the sweep's quant=none,qwz,hpz,qgz,zeropp (the command line wins)" in p.stderr
    p = run_cli_here(["sweep=ablation", "train.seed=3", *MINI_1X2_CPU, f"hydra.sweep.dir={tmp_path / 'b'}"], capfd)
    assert calls == [1] * 6 and "replaces the sweep's" not in p.stderr, p.stderr[-2000:]


def test_the_replaced_axis_note_matches_keys_as_hydras_sweeper_merges_them(capsys: pytest.CaptureFixture[str]) -> None:
    """Only an override Hydra's sweeper merges with the preset's (the same key element) is named:
    ``~quant``, ``quant@x=...``, ``++quant=...`` and ``trainer_job=...`` beside ``+trainer_job`` are
    other entries that Hydra keeps beside the preset's axis."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from hydra_plugins.zeropp_sweeper import ZeroppSweeper

    parse = OverridesParser.create().parse_overrides
    preset = parse(["quant=none,qwz", "+trainer_job=zeropp,ddp", "stage=3"])
    for given in (["~quant"], ["quant@x=hpz"], ["++quant=hpz"], ["trainer_job=ddp"], ["stage=2"]):
        ZeroppSweeper._note_replaced_axes(preset, parse(given))
        assert capsys.readouterr().err == "", given
    ZeroppSweeper._note_replaced_axes(preset, parse(["quant=hpz", "+trainer_job=ddp"]))
    err = capsys.readouterr().err
    assert "quant=hpz replaces the sweep's quant=none,qwz" in err
    assert "+trainer_job=ddp replaces the sweep's +trainer_job=zeropp,ddp" in err


def test_a_sweep_resumed_in_a_directory_where_none_of_its_points_began_is_refused(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``resume=true`` with a mistyped (or Hydra's default, new) ``hydra.sweep.dir``: no point has a
    checkpoint, records or a start there, so this is not the sweep to resume; exit 2 before any point
    (a resumed sweep starts its points that never ran only beside points that did: else every point
    would silently retrain from scratch)."""
    calls: list[int] = []
    monkeypatch.setattr(runner_job, "launch", _launch_recorder(calls))
    sweep = tmp_path / "typo"
    args = ["-m", *MINI_1X2_CPU, "train.steps=4", "train.checkpoint_every=2", "resume=true", "train.seed=1,2"]
    p = run_cli_here([*args, f"hydra.sweep.dir={sweep}"], capfd)
    assert p.returncode == 2 and calls == [], p.stderr[-2000:]
    assert f"no point of this sweep has a checkpoint, records or a start under {sweep}" in p.stderr
