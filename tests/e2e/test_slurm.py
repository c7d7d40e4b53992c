"""Slurm, for real: a 2-point sweep through ``hydra/launcher=slurm`` and a 2-rank job through
``scripts/slurm/train.sbatch``, on a one-node Slurm cluster started on this machine
(``tests/slurm_cluster.py``; skipped with the reason where it cannot start). Plus the refusals a
user meets before anything is submitted, which need no cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from tests.experiment_helpers import MINI_1X2_CPU, run_cli, run_cli_here
from tests.slurm_cluster import SlurmCluster, start_cluster, unavailable

REPO = Path(__file__).resolve().parents[2]
SBATCH_SCRIPT = REPO / "scripts" / "slurm" / "train.sbatch"
TINY_CPU = [
    "model=tiny",
    "model.seq_len=32",
    "train.steps=2",
    "train.micro_batch_size=2",
    "data=random",
    "logger=none",
    "launcher.progress=false",
    "launcher.device=cpu",
]
"""A run of seconds on CPU ranks, without a topology: the sweep's points pose ``topology=1x2``;
under the sbatch script the topology is torchrun's."""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    why = unavailable()
    if why is not None:
        pytest.skip(why)
    try:
        cluster = start_cluster(tmp_path_factory.mktemp("slurm"))
    except RuntimeError as e:  # installed, but the daemons do not come up here (the message has their logs)
        pytest.skip(f"Slurm is installed but could not start on this machine: {e}")
    try:
        yield cluster
    finally:
        cluster.stop()
    assert cluster.leftover_pids() == [], "processes of the test cluster outlived its stop()"


def _client_env(cluster: SlurmCluster) -> dict[str, str]:
    """What the runner needs in its environment to submit to ``cluster``."""
    return {k: cluster.env[k] for k in ("SLURM_CONF", "PATH")}


def test_sweep_submits_one_slurm_job_per_point(slurm: SlurmCluster, tmp_path: Path) -> None:
    """Three points, each a Slurm job of one array. Point 0's job script fails before the runner
    starts (a setup line exits 3, as a failing ``module load`` would: no result comes back), point
    1 diverges while training (the runner records it on the node), point 2 trains. The sweep still
    ends; the submitting command names points 0 and 1 and exits 3 (the worst code); each failed
    point has failed.json, point 2 its summary; the report lists them. (An invalid config is
    refused before anything is submitted: ``test_an_invalid_point_is_refused_before_submitting``.)"""
    sweep = tmp_path / "sweep"
    p = run_cli(
        [
            "-m",
            "optim.lr=0.003,1e30,0.002",
            "topology=1x2",
            *TINY_CPU,
            "hydra/launcher=slurm",
            "hydra.launcher.setup=['test $SLURM_ARRAY_TASK_ID -ne 0 || exit 3']",
            "slurm.time_min=5",
            "slurm.cpus_per_task=1",
            f"hydra.sweep.dir={sweep}",
        ],
        env=_client_env(slurm),
        timeout=150,
    )
    assert p.returncode == 3, p.stdout[-3000:] + p.stderr[-3000:] + slurm.logs()
    assert "2 multirun job(s) failed" in p.stderr and "optim.lr=1e+30" in p.stderr  # (as Hydra spells it)
    dead = json.loads((sweep / "0" / "failed.json").read_text())
    assert dead["exit_code"] == 1 and dead["overrides"][0] == "optim.lr=0.003"
    assert dead["error"].startswith("Slurm job ") and "ended without a result" in dead["error"]
    assert not (sweep / "0" / "summary.json").exists()
    diverged = json.loads((sweep / "1" / "failed.json").read_text())
    assert "diverged" in diverged["error"] and diverged["exit_code"] == 3
    summary = json.loads((sweep / "2" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 2 and "optim.lr=0.002" in summary["overrides"]
    # the runner ran inside Slurm jobs (submitit's folder per array task, a result from each that ran)
    tasks = sorted(d.name for d in (sweep / ".submitit").iterdir() if d.is_dir() and "_" in d.name)
    assert len(tasks) == 3 and [(sweep / ".submitit" / t / f"{t}_0_result.pkl").is_file() for t in tasks] == [
        False,
        True,
        True,
    ]
    r = subprocess.run(
        [sys.executable, "-m", "zeropp.experiments.report", str(sweep)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    md = (sweep / "report.md").read_text()
    assert "optim.lr=1e+30" in md and "optim.lr=0.003" in md
    # the dead job is left out; the diverged one is a row (its failure listed, not counted as left out)
    assert "2 runs, 1 failed (not in the table or plots)" in md and "(diverged at step" in md


def test_an_invalid_point_is_refused_before_submitting(slurm: SlurmCluster, tmp_path: Path) -> None:
    """A sweep whose second point cannot work (an hpZ group that does not divide the node) is refused
    by the submitting command before any Slurm job exists: exit 2 naming the point, no array
    submitted (``hydra/sweeper=zeropp``), run from outside the checkout (Hydra's plugin scan must
    find the sweeper and the launcher there too)."""
    sweep = tmp_path / "sweep"
    before = subprocess.run(
        ["squeue", "-h", "-o", "%i"], capture_output=True, text=True, env={**os.environ, **_client_env(slurm)}
    )
    p = run_cli(
        ["-m", "zero.hpz_size=2,3", "quant=hpz", "topology=1x2", *TINY_CPU, "hydra/launcher=slurm"]
        + ["slurm.time_min=5", f"hydra.sweep.dir={sweep}"],
        env=_client_env(slurm),
        timeout=150,
        cwd=tmp_path,
    )
    assert p.returncode == 2, p.stdout[-3000:] + p.stderr[-3000:]
    assert "1 of 2 sweep point(s) cannot run; no point was started" in p.stderr and "zero.hpz_size=3" in p.stderr
    assert not (sweep / ".submitit").exists()
    after = subprocess.run(
        ["squeue", "-h", "-o", "%i"], capture_output=True, text=True, env={**os.environ, **_client_env(slurm)}
    )
    assert after.stdout == before.stdout


def test_a_partition_sbatch_refuses_is_one_error_line(slurm: SlurmCluster, tmp_path: Path) -> None:
    """A mistyped partition: the real sbatch refuses the job array, and the command says so in one
    line with sbatch's words, exit 2 (before: submitit's FailedJobError traceback)."""
    sweep = tmp_path / "sweep"
    p = run_cli(
        ["-m", "stage=2,3", "topology=1x2", *TINY_CPU, "hydra/launcher=slurm", "slurm.partition=nosuchpartition"]
        + ["slurm.time_min=5", f"hydra.sweep.dir={sweep}"],
        env=_client_env(slurm),
        timeout=150,
    )
    assert p.returncode == 2, p.stdout[-3000:] + p.stderr[-3000:]
    assert "error: sbatch refused the sweep's jobs, so none was submitted: " in p.stderr, p.stderr[-3000:]
    assert "partition" in p.stderr.split("error: sbatch refused", 1)[1] and "Traceback" not in p.stderr


def test_train_sbatch_runs_torchrun_with_the_topology_from_slurm(slurm: SlurmCluster, tmp_path: Path) -> None:
    """sbatch --cpus-per-task=2: one torchrun agent on the node starts 2 CPU ranks; the run's
    topology (1 node x 2 ranks) comes from torchrun's environment, not from the command line."""
    run_dir = tmp_path / "run"
    env = {k: v for k, v in slurm.env.items() if k != "ZEROPP_INJECT_FAULT"}
    env.update(PYTHON=sys.executable, WANDB_MODE="offline")
    p = subprocess.run(
        [
            "sbatch",
            "--wait",
            "--nodes=1",
            "--cpus-per-task=2",
            "--time=5",
            f"--output={tmp_path / 'job.out'}",
            str(SBATCH_SCRIPT),
            *TINY_CPU,
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    out = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").is_file() else ""
    assert p.returncode == 0, p.stdout + p.stderr + out[-4000:] + slurm.logs()
    assert "1 node(s) x 2 rank(s), rendezvous " in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 2
    assert summary["placement"] == {"cluster": "torchrun", "nodes": 1, "ranks_per_node": 2, "declared": []}
    assert summary["topology"]["nodes"] == 1 and summary["topology"]["ranks_per_node"] == 2


def test_train_sbatch_refuses_several_tasks_per_node(slurm: SlurmCluster, tmp_path: Path) -> None:
    """--ntasks-per-node=2 would start two torchrun agents per node: the job stops at once, saying why."""
    p = subprocess.run(
        ["sbatch", "--wait", "--ntasks-per-node=2", f"--output={tmp_path / 'job.out'}", str(SBATCH_SCRIPT), "stage=3"],
        cwd=tmp_path,
        env=slurm.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = (tmp_path / "job.out").read_text()
    assert p.returncode == 2, p.stdout + p.stderr + out
    assert "one task per node is torchrun's agent" in out and "--ntasks-per-node=2" in out


def test_train_sbatch_outside_slurm_says_to_submit_it(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    p = subprocess.run(["bash", str(SBATCH_SCRIPT), "stage=3"], env=env, capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "submit this script with sbatch" in p.stderr, p.stderr


def test_slurm_sweep_without_sbatch_is_refused_before_anything_is_submitted(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """PATH without Slurm's commands: exit 2 with the fix, and no sweep directory is made."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    sweep = tmp_path / "sweep"
    p = run_cli_here(
        ["-m", "stage=2,3", "hydra/launcher=slurm", f"hydra.sweep.dir={sweep}"],
        capfd,
        env={"PATH": str(bindir)},
        timeout=60,
    )
    assert p.returncode == 2, p.stderr
    assert "error: hydra/launcher=slurm submits with sbatch, which is not on PATH" in p.stderr
    assert not sweep.exists()


def test_slurm_sweep_without_the_extra_names_the_install(tmp_path: Path) -> None:
    """An environment where submitit cannot be imported (a package on PYTHONPATH standing in for
    a missing one, as pip leaves it after an uninstall of a dependency): exit 2 naming the extra."""
    shadow = tmp_path / "site"
    (shadow / "submitit").mkdir(parents=True)
    (shadow / "submitit" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'submitit'\")\n")
    sweep = tmp_path / "sweep"
    p = run_cli(
        ["-m", "stage=2,3", "hydra/launcher=slurm", f"hydra.sweep.dir={sweep}"],
        env={"PYTHONPATH": str(shadow)},
        timeout=60,
    )
    assert p.returncode == 2, p.stderr
    assert "needs the Slurm extra" in p.stderr and "pip install 'zeropp[slurm]'" in p.stderr
    assert not sweep.exists()


def test_slurm_keys_with_the_local_launcher_are_refused(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    p = run_cli_here([*MINI_1X2_CPU, "slurm.partition=gpu", f"hydra.run.dir={tmp_path / 'run'}"], capfd, timeout=60)
    assert p.returncode == 2, p.stderr
    assert "slurm.partition='gpu' does nothing with hydra/launcher=basic" in p.stderr
    assert not (tmp_path / "run" / "ranks").exists()


def _fake_slurm_job(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """train.sbatch as a job's batch step would run it, with ``srun`` and ``scontrol`` stand-ins on
    PATH (srun records its arguments and starts nothing): what srun would have been asked to run."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    argv_file = tmp_path / "srun.argv"
    (bindir / "srun").write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" > {argv_file}\n')
    # a job of 50,000 nodes' worth of host names: more than a pipe holds, as a large job's list is
    (bindir / "scontrol").write_text("#!/usr/bin/env bash\nseq -f node%g 1 50000\n")
    for f in ("srun", "scontrol"):
        (bindir / f).chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "ZEROPP_RDZV"))}
    job = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "node[1-2]"}
    full = {**base, **job, "PYTHON": sys.executable, "PATH": f"{bindir}:{base['PATH']}", **env}
    p = subprocess.run(["bash", str(SBATCH_SCRIPT), "stage=3"], env=full, capture_output=True, text=True, timeout=60)
    return p, argv_file.read_text().splitlines() if argv_file.exists() else []


def test_train_sbatch_passes_cpus_per_task_to_srun_only_when_the_job_has_it(tmp_path: Path) -> None:
    """A GPU job without --cpus-per-task: no empty argument (under set -u an empty array was an
    unbound variable in bash < 4.4, failing every such job); with it, srun gets it back. The head
    node of a long host list is its first (before: ``| head -n 1`` killed scontrol with SIGPIPE and
    pipefail ended the job with status 141 and no message)."""
    p, argv = _fake_slurm_job(tmp_path, SLURM_GPUS_ON_NODE="4")
    assert p.returncode == 0, p.stderr
    assert not any(a.startswith("--cpus-per-task") for a in argv) and "" not in argv
    assert "--nproc-per-node=4" in argv and "--rdzv-endpoint=node1:24242" in argv and argv[-1] == "stage=3"
    p, argv = _fake_slurm_job(tmp_path, SLURM_CPUS_PER_TASK="2")
    assert p.returncode == 0, p.stderr
    assert "--cpus-per-task=2" in argv and "--nproc-per-node=2" in argv


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"PYTHON": "/nonexistent/python3"}, "PYTHON=/nonexistent/python3 is not an interpreter"),
        ({"PYTHON": "env"}, "env cannot import zeropp; activate the environment"),
        ({"ZEROPP_RDZV_PORT": "abc"}, "ZEROPP_RDZV_PORT=abc is not a TCP port from 1024 to 65535"),
        ({"ZEROPP_RDZV_PORT": "80"}, "ZEROPP_RDZV_PORT=80 is not a TCP port"),
    ],
)
def test_train_sbatch_with_a_bad_environment_stops_before_srun(tmp_path: Path, env: dict, words: str) -> None:
    """Before: srun started the step on every node, and each failed there (exec error, no module
    zeropp, torchrun's port parse), one log per node."""
    p, argv = _fake_slurm_job(tmp_path, **env)
    assert p.returncode == 2 and words in p.stderr, p.stderr
    assert argv == []
