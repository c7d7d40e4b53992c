"""``python -m experiments.run [overrides]``: the experiment runner (a thin Hydra app).

Composes ``conf/``, validates it (experiments/config.py), then either spawns one process per rank
(launcher.py) or, under torchrun, runs this process as its rank (worker.py). Outputs land in
Hydra's run directory: ``metrics.jsonl``, ``summary.json``, ``ranks/`` and ``wandb/``.

    python -m experiments.run stage=3 quant=int8
    python -m experiments.run -m stage=1,2,3 quant=none,int8,int4
    python -m experiments.run sweep=ablation
    torchrun --nnodes 2 --nproc-per-node 8 ... -m zeropp.experiments.run topology.world_size=16 topology.ranks_per_node=8
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from .config import ConfigError, RunConfig, check_zero_runtime, from_omegaconf
from .launcher import RankFailure, emulated_placement, in_torchrun, launch, local_placement, worker_module
from .metrics import read_summary, write_summary
from .overrides import check_overrides


def _notes(cfg: RunConfig) -> list[str]:
    """Say where a requested switch has no effect, so a summary never over-claims."""
    z, notes = cfg.zero, []
    if cfg.trainer.name == "zeropp" and z.stage < 3 and (z.qwz_bits or z.hpz):
        notes.append(f"qwZ/hpZ need sharded weights (stage 3); not applied at stage {z.stage}")
    if cfg.trainer.name in ("fsdp2", "ddp") and (z.qwz_bits or z.hpz or z.qgz_bits):
        notes.append(f"trainer={cfg.trainer.name} uses PyTorch's own collectives; zero.* quantization ignored")
    if cfg.trainer.name != "zeropp" and z.stage != 3:
        notes.append(f"zero.stage={z.stage} ignored by trainer={cfg.trainer.name}")
    return notes


def _hydra_info() -> dict[str, Any]:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    return {
        "run_dir": hc.runtime.output_dir,
        "overrides": list(hc.overrides.task),
        "name": hc.job.override_dirname or "defaults",
        "group": "_".join(Path(hc.sweep.dir).parts[-2:]) if multirun else None,  # e.g. 2026-11-21_20-03-40
        "multirun": multirun,
    }


def execute(cfg: DictConfig) -> dict[str, Any] | None:
    """Validate, launch, and return rank 0's summary (None on other torchrun ranks)."""
    rc = from_omegaconf(cfg)
    check_zero_runtime(rc)
    info = _hydra_info()
    run_dir = Path(info["run_dir"])
    spec = {"config": rc.to_dict(), "run_dir": str(run_dir), "name": info["name"], "group": info["group"],
            "overrides": info["overrides"], "notes": _notes(rc)}
    if in_torchrun():
        from .worker import run_rank

        return run_rank(spec)
    t = rc.topology
    if rc.cluster.name == "emulated":
        placement = emulated_placement(t.world_size, t.ranks_per_node, rc.cluster.inter_gbps,
                                       rc.cluster.inter_latency_ms)
    else:
        placement = local_placement(t.world_size)
    print(f"zeropp: {rc.describe()} -> {run_dir}", file=sys.stderr, flush=True)
    info = launch(module=worker_module(__package__), spec=spec, run_dir=run_dir, world_size=t.world_size,
                  ranks_per_node=t.ranks_per_node, placement_cm=placement, timeout_s=rc.launcher.timeout_s,
                  grace_s=rc.launcher.grace_s)
    summary = read_summary(run_dir / "summary.json")
    summary["placement"] = info  # e.g. the emulated links' configured and measured rates
    write_summary(run_dir / "summary.json", summary)
    return summary


FAILED_FILE = "failed.json"
"""Written into a multirun job's directory when that job fails (its overrides and the error)."""

_failed: list[dict[str, Any]] = []  # this process's failed multirun jobs (Hydra runs them in-process, in order)


def _record_failure(error: str, exit_code: int) -> None:
    """In a multirun, keep going: note the failed job in its directory and for the final message."""
    import json

    info = _hydra_info()
    job = {"run_dir": info["run_dir"], "overrides": info["overrides"], "error": error, "exit_code": exit_code}
    Path(info["run_dir"]).mkdir(parents=True, exist_ok=True)
    (Path(info["run_dir"]) / FAILED_FILE).write_text(json.dumps(job, indent=1) + "\n")
    _failed.append(job)


@hydra.main(version_base="1.3", config_path="pkg://zeropp.conf", config_name="config")
def _hydra_main(cfg: DictConfig) -> float | None:
    try:
        summary = execute(cfg)
    except (ConfigError, RankFailure) as e:
        code = 2 if isinstance(e, ConfigError) else (e.exit_code if e.exit_code and e.exit_code > 0 else 1)
        print(f"error: {e}", file=sys.stderr, flush=True)
        if in_torchrun() or not _hydra_info()["multirun"]:
            sys.exit(code)
        _record_failure(str(e), code)  # the sweep's other jobs still run; the command exits non-zero at the end
        return None
    return None if summary is None else float(summary["tokens_per_s"])


def cli() -> None:
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
