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
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record

from . import schema
from .config import ConfigError, RunConfig, from_omegaconf
from .launcher import RankFailure, emulated_placement, in_torchrun, launch, local_placement, worker_module
from .metrics import read_summary, write_summary
from .overrides import check_overrides

schema.register()


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
    }


def execute(rc: RunConfig, info: dict[str, Any]) -> dict[str, Any] | None:
    """Launch the validated run; rank 0's summary (None on other torchrun ranks)."""
    run_dir = Path(info["run_dir"])
    rc.check_resume(run_dir)
    label = rc.describe(info["model_name"])
    spec = {"config": rc.to_dict(), "run_dir": str(run_dir), "name": info["name"], "group": info["group"],
            "overrides": info["overrides"], "label": label, "model_name": info["model_name"]}
    if in_torchrun():
        from .worker import run_rank

        if rc.cluster.name == "emulated":
            raise ConfigError("invalid config: cluster=emulated under torchrun; the emulator starts its ranks itself "
                              "inside network namespaces: run `python -m experiments.run cluster=emulated ...` "
                              "without torchrun")
        launched = int(os.environ["WORLD_SIZE"])
        if launched != rc.world_size:  # before this rank joins anything, on every rank
            raise ConfigError(f"invalid config: torchrun started {launched} ranks but topology.nodes x "
                              f"topology.ranks_per_node = {rc.topology.nodes} x {rc.topology.ranks_per_node} = "
                              f"{rc.world_size}; pass topology.nodes=<nodes> topology.ranks_per_node=<ranks per node> "
                              f"multiplying to {launched}")

        summary = run_rank(spec)
        if summary is not None:  # rank 0: record how the ranks were started, as the launcher does
            summary["placement"] = {"cluster": "torchrun"}
            write_summary(run_dir / "summary.json", summary)
        return summary
    t = rc.topology
    if rc.launcher.device == "cuda":  # the ranks would each refuse; say it once, before starting them
        import torch

        if torch.cuda.device_count() < t.world_size:
            raise ConfigError(f"invalid config: launcher.device=cuda starts {t.world_size} ranks on this host but it "
                              f"has {torch.cuda.device_count()} GPU(s); choose a topology of at most that many ranks "
                              "(topology=1x1), launcher.device=cpu, or torchrun across hosts")
    placement = (emulated_placement(t.world_size, t.ranks_per_node, rc.cluster.inter_gbps, rc.cluster.inter_latency_ms,
                                    device=rc.launcher.device)
                 if rc.cluster.name == "emulated" else local_placement(t.world_size))
    print(f"zeropp: {label} -> {run_dir}", file=sys.stderr, flush=True)
    placed = launch(module=worker_module(__package__), spec=spec, run_dir=run_dir, world_size=t.world_size,
                    ranks_per_node=t.ranks_per_node, placement_cm=placement, timeout_s=rc.launcher.timeout_s,
                    grace_s=rc.launcher.grace_s)
    summary = read_summary(run_dir / "summary.json")
    summary["placement"] = placed  # e.g. the emulated links' configured and measured rates
    write_summary(run_dir / "summary.json", summary)
    return summary


def run_job(overrides: list[str], run_dir: str | Path) -> dict[str, Any]:
    """Compose ``overrides`` like the command line, run the job into ``run_dir``, return its
    summary. For benchmarks and tests that run several jobs from Python; raises ConfigError or
    RankFailure as the command would."""
    from hydra import compose, initialize_config_module

    check_overrides(overrides)
    with initialize_config_module("zeropp.conf", version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    info = {"run_dir": str(run_dir), "overrides": list(overrides), "name": ",".join(overrides) or "defaults",
            "group": None, "multirun": False, "model_name": cfg.hydra.runtime.choices.get("model") or ""}
    rc = from_omegaconf(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]))
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    summary = execute(rc, info)
    assert summary is not None
    return summary


FAILED_FILE = "failed.json"
"""Written into a multirun job's directory when that job fails (its overrides and the error)."""

_failed: list[dict[str, Any]] = []  # this process's failed multirun jobs (Hydra runs them in-process, in order)


def _record_failure(info: dict[str, Any], error: str, exit_code: int) -> None:
    """In a multirun, keep going: note the failed job in its directory and for the final message."""
    job = {"run_dir": info["run_dir"], "overrides": info["overrides"], "error": error, "exit_code": exit_code}
    Path(info["run_dir"]).mkdir(parents=True, exist_ok=True)
    (Path(info["run_dir"]) / FAILED_FILE).write_text(json.dumps(job, indent=1) + "\n")
    _failed.append(job)


@hydra.main(version_base="1.3", config_path="pkg://zeropp.conf", config_name="config")
def _hydra_main(cfg: DictConfig) -> float | None:
    info = _hydra_info()
    try:
        summary = execute(from_omegaconf(cfg), info)
    except (ConfigError, RankFailure) as e:
        code = 2 if isinstance(e, ConfigError) else (e.exit_code if e.exit_code and e.exit_code > 0 else 1)
        print(f"error: {e}", file=sys.stderr, flush=True)
        if in_torchrun() or not info["multirun"]:
            sys.exit(code)
        _record_failure(info, str(e), code)  # the sweep's other jobs still run; the command exits non-zero at the end
        return None
    return None if summary is None else float(summary["tokens_per_s"])


@record  # under torchrun: a rank's exception goes to torch's error file
def cli() -> None:
    if in_torchrun() and any(a in ("-m", "--multirun") or a.startswith("sweep=") for a in sys.argv[1:]):
        print("error: multirun/sweeps under torchrun are not supported (every job would re-join the same "
              "rendezvous); run one job per torchrun, or sweep with `python -m experiments.run -m ...` locally",
              file=sys.stderr)
        sys.exit(2)
    try:
        check_overrides(sys.argv[1:])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    _hydra_main()
    if _failed:
        print(f"error: {len(_failed)} multirun job(s) failed (each directory has {FAILED_FILE}):", file=sys.stderr)
        for job in _failed:
            print(f"  {job['run_dir']}: {' '.join(job['overrides'])}: {job['error'].splitlines()[0]}", file=sys.stderr)
        sys.exit(max(j["exit_code"] for j in _failed))


if __name__ == "__main__":
    cli()
