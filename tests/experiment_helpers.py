"""Helpers for tests that drive the experiment runner: the command as a user types it, the config
it composes, the bad command lines it must refuse, and what a run left in its checkpoint directory."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

TINY_RUN = ["model=tiny", "model.seq_len=32", "train.micro_batch_size=4", "data.max_bytes=200000", "logger=none"]
"""Overrides of a run that takes seconds: the tiny GPT on a slice of the text corpus, no logger."""

MINI_1X2_CPU = [
    "model=mini",
    "topology=1x2",
    "train.steps=2",
    "train.micro_batch_size=2",
    "data=random",
    "logger=none",
    "launcher.progress=false",
    "launcher.device=cpu",
]
"""Overrides of a two-step run of the mini GPT on random data, one node of two CPU ranks."""

CLI_ERRORS: list[tuple[list[str], list[str]]] = [
    (["quant=int9"], ["quant", "allowed", "int8"]),
    (["stage=5"], ["stage", "5"]),
    (["topology.nodes=2", "topology.ranks_per_node=-1"], ["topology.ranks_per_node"]),
    (["zero.reduce_bucket_size=-5"], ["zero.reduce_bucket_size"]),
    (["trainer=ddp", "zero.prefetch_depth=3"], ["prefetch_depth", "trainer=ddp"]),
    (["train.steps=abc"], ["error: invalid config: train.steps=abc: expected an integer"]),
    (["data.source=path", "data.path=/nonexistent"], ["data.path='/nonexistent' does not exist"]),
    (["~zero.grad_clip"], ["~zero.grad_clip deletes a key", "zero.grad_clip=<value> (null is one of its values)"]),
    (["~train.stpes"], ["unknown config key 'train.stpes'", "did you mean train.steps"]),
    (["model=tiny,mini"], ["model=tiny,mini gives several values, which only a sweep runs; add -m"]),
    # an hpZ group that would split a tensor-parallel group (before: every rank raised it after start-up)
    (
        ["topology=2x2", "topology.tp=2", "zero.hpz=true", "zero.hpz_size=1"],
        ["zero.hpz_size=1 against topology.tp=2", "must be a multiple of tp=2"],
    ),
    # a value Hydra's grammar cannot read (before: Hydra's lexer message and a link, exit 1)
    (["zero.nvme_path=~/scratch"], ["error: invalid config: zero.nvme_path=~/scratch: Hydra cannot parse", "'~'"]),
    (["train.steps=a=b)("], ["train.steps=a=b)(: Hydra cannot parse this override (mismatched input"]),
    (["hydra.run.dir="], ["hydra.run.dir= is an empty path", "current directory"]),
    (["-m", "train.seed=1,2", "hydra.sweep.dir="], ["hydra.sweep.dir= is an empty path"]),
    (["zero.reduce_bucket_size=${oops}"], ["zero.reduce_bucket_size=${oops}: Interpolation key 'oops' not found"]),
    *([(["launcher.device=cuda"], ["launcher.device=cuda", "GPU"])] if torch.cuda.device_count() < 4 else []),
]
"""Bad command lines of every stage of the runner's checks (override pre-check, Hydra composition,
validation, pre-launch checks) and the words their one error line must contain."""


def run_cli(
    args: list[str],
    *,
    torchrun_ranks: int | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 150,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess:
    """``python -m zeropp.experiments.run <args>`` (or under ``torchrun --nproc-per-node <n>``),
    output captured, wandb offline, no injected fault inherited from the test's environment;
    ``cwd``: where it runs (None: this process's directory, the checkout's root)."""
    e = {k: v for k, v in os.environ.items() if k != "ZEROPP_INJECT_FAULT"}
    e.update(WANDB_MODE="offline", WANDB_SILENT="true", **(env or {}))
    pre = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(torchrun_ranks), "-m"]
        if torchrun_ranks
        else [sys.executable, "-m"]
    )
    return subprocess.run(
        [*pre, "zeropp.experiments.run", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=e,
        check=False,
        cwd=cwd,
    )


class RunnerTimeout(BaseException):
    """:func:`run_cli_here`'s bound on the whole command passed; raised in the command, where the
    launcher's cleanup stops the ranks. A BaseException, like KeyboardInterrupt, so that no
    ``except Exception`` on the way (Hydra reports those as a failed command) turns it into an
    exit status: the test fails with it, as ``subprocess.run``'s TimeoutExpired fails one."""


def run_cli_here(
    args: list[str], capfd: pytest.CaptureFixture[str], *, env: dict[str, str] | None = None, timeout: float = 150
) -> subprocess.CompletedProcess:
    """:func:`run_cli` without the runner's own interpreter: the same ``cli()`` that ``python -m
    zeropp.experiments.run <args>`` calls, with ``sys.argv`` set, run in this process, and the
    real launch (each rank a fresh ``python -m ...worker`` process, as from the command line). It
    saves a job the seconds of importing torch, Hydra and torch's elastic launcher that the
    runner's interpreter spends before it starts a rank; the ranks' own start-up is unchanged.

    The same environment as :func:`run_cli` (no inherited injected fault, wandb offline, ``env``
    on top; restored afterwards), and the same result: exit status (``sys.exit``'s code, 0 when
    ``cli()`` returns), stdout and stderr (the runner's and its ranks', captured at the file
    descriptors by ``capfd``). ``timeout`` bounds the whole call as ``subprocess.run``'s does: a
    SIGALRM raises :class:`RunnerTimeout` where the command is (in the launcher's wait, whose
    cleanup stops every rank), and it reaches the test. The process-wide state the runner keeps
    between commands (its list of failed multirun jobs) starts empty, as in a fresh process."""
    import zeropp.experiments.runner.run as run

    def expire(signum: int, frame: object) -> None:
        raise RunnerTimeout(f"the command ran past run_cli_here's timeout of {timeout} s")

    capfd.readouterr()
    code: int | str | None = 0
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("ZEROPP_INJECT_FAULT", raising=False)
        for k, v in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", **(env or {})}.items():
            mp.setenv(k, v)
        mp.setattr(sys, "argv", ["zeropp.experiments.run", *args])
        mp.setattr(run, "_failed", [])
        previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            run.cli()
        except SystemExit as e:
            code = e.code
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    out = capfd.readouterr()
    returncode = code if isinstance(code, int) else 0 if code is None else 1  # as the interpreter maps it
    return subprocess.CompletedProcess(["zeropp.experiments.run", *args], returncode, out.out, out.err)


def checkpoint_steps(root: Path) -> tuple[int | None, list[int]]:
    """(step of the checkpoint ``root/LATEST`` names, steps of every checkpoint directory under
    ``root``), read from each one's own record, its ``meta.json`` (both trainer families)."""

    def step(d: Path) -> int:
        return int(json.loads((d / "meta.json").read_text())["step"])

    latest = root / "LATEST"
    named = step(root / latest.read_text().strip()) if latest.is_file() else None
    return named, sorted(step(d) for d in root.iterdir() if d.is_dir())


def rolled_back_copy(root: Path, step: int, dest: Path) -> Path:
    """A copy of the checkpoint directory ``root`` at ``dest`` whose ``LATEST`` names the version of
    ``step`` (the version folder is copied, not touched in ``root``), committed as a save would
    (``checkpoint_files.commit``). ``resume=true train.checkpoint_dir=<dest>`` then continues from
    that step of the run that wrote ``root``: one uninterrupted run serves as the reference and
    as the checkpoint a resumed run starts from, instead of a second run stopped there."""
    from zeropp.runtime.checkpoint_files import NAME, commit

    versions = [d for d in root.iterdir() if d.is_dir() and NAME.fullmatch(d.name)]
    at = [d for d in versions if json.loads((d / "meta.json").read_text())["step"] == step]
    assert len(at) == 1, f"{root}: want one version of step {step}, found {sorted(d.name for d in versions)}"
    dest.mkdir(parents=True)
    shutil.copytree(at[0], dest / at[0].name)
    commit(dest, at[0].name)
    return dest


def _composed(overrides: list[str]) -> tuple[Any, Any]:
    """(Hydra's composed config with its ``hydra`` node, the validated RunConfig) of ``overrides``,
    as the runner builds them (no rank started)."""
    from hydra import compose, initialize_config_module

    from zeropp.experiments.runner.run import validated, without_hydra

    with initialize_config_module("zeropp.conf", version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    return cfg, validated(without_hydra(cfg), list(overrides))


def composed_summary(overrides: list[str]) -> dict:
    """The part of a ``summary.json`` that names a run (``config``, ``model.name``, ``overrides``),
    as the runner would write it for ``overrides``: composed by Hydra and validated, no rank started."""
    cfg, rc = _composed(overrides)
    return {
        "config": rc.to_dict(),
        "model": {"name": cfg.hydra.runtime.choices.get("model") or ""},
        "overrides": list(overrides),
        "trainer": rc.trainer.name,
    }


def composed_sweep(*axes: list[str]) -> list[dict]:
    """:func:`composed_summary` of every job of a multirun, in Hydra's order (the last axis varies
    fastest): ``composed_sweep(["stage=1", "stage=3"], ["quant=none", "quant=int8"])``."""
    import itertools

    return [composed_summary(list(job)) for job in itertools.product(*axes)]


def legends_over_data(fig) -> list[str]:
    """The texts of ``fig``'s legends (figure and axes ones) whose box overlaps a visible axes' box
    once drawn: a legend there covers data. Empty when every legend sits outside every axes."""
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    boxes = [ax.get_window_extent(r) for ax in fig.axes if ax.get_visible()]
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    bad = []
    for leg in legends:
        b = leg.get_window_extent(r)
        if any(b.x0 < a.x1 and a.x0 < b.x1 and b.y0 < a.y1 and a.y0 < b.y1 for a in boxes):
            bad.append(", ".join(t.get_text() for t in leg.get_texts()))
    return bad


def composed_config(*overrides: str) -> dict:
    """The config ``python -m zeropp.experiments.run <overrides>`` composes, resolved to plain
    containers (before validation)."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    import zeropp.experiments.runner.run  # noqa: F401 - registers the generated schema and groups

    with initialize_config_module(config_module="zeropp.conf", version_base="1.3"):
        return OmegaConf.to_container(compose("config", overrides=list(overrides)), resolve=True)  # type: ignore[return-value]


def _train_rank(rank: int, world: int, spec: dict) -> dict | None:
    """One rank of :func:`train_in_world`: the worker's training loop on this forked gloo rank."""
    from zeropp.experiments.runner.config import from_dict
    from zeropp.experiments.runner.worker import _train

    return _train(from_dict(spec["config"]), spec, Path(spec["run_dir"]), rank, world, torch.device("cpu"), "gloo")


def train_in_world(overrides: list[str], run_dir: Path) -> dict:
    """The summary of the job ``overrides`` as :func:`zeropp.experiments.runner.run.run_job` runs it
    (composed by Hydra and validated here, each rank the worker's own training loop, rank 0 writing
    ``run_dir``), on a gloo world forked from the tests' preloaded fork server
    (:func:`tests.worlds.run_world`) instead of spawned worker interpreters: a rank starts in a
    fraction of a second instead of seconds of imports. For tests of what a config key does to
    training; the launch itself (spawned ranks, their spec file, failures) is the e2e tier's."""
    from tests.worlds import run_world
    from zeropp.experiments.runner.job import job_spec
    from zeropp.experiments.runner.run import check_overrides

    check_overrides(overrides)  # the command line's first check, as run_job makes it
    cfg, rc = _composed(overrides)
    model_name = cfg.hydra.runtime.choices.get("model") or ""
    info = {"run_dir": str(run_dir), "overrides": list(overrides), "name": ",".join(overrides), "group": None}
    run_dir.mkdir(parents=True, exist_ok=True)
    summary = run_world(_train_rank, rc.topology.world_size, job_spec(rc, {**info, "model_name": model_name}))[0]
    assert summary is not None
    return summary
