"""Shared pieces of the Hugging Face export tests: engine checkpoints written the way the runner
writes them (a world of one process, ``ZeroEngine.save_checkpoint`` with the model settings in
``extra["model"]``), the logits of our model and of a ``transformers`` directory, and the
held-out loss of an exported model on the runner's own evaluation batches."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@contextlib.contextmanager
def world_of_one(store: Path) -> Iterator[None]:
    """This process as the only rank of a gloo world (destroyed on exit): what the engine needs."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def model_record(cfg: Any) -> dict[str, Any]:
    """``cfg``'s settings as the runner records them in a checkpoint (``RunConfig.to_dict()["model"]``)."""
    from zeropp.models import HFConfig

    return {"kind": "hf" if isinstance(cfg, HFConfig) else "gpt", **dataclasses.asdict(cfg)}


def runner_record(cfg: Any) -> dict[str, Any]:
    """What the runner adds to a checkpoint's ``extra`` about the model: its settings and, for a
    Hugging Face model, the ``transformers`` config it was built with."""
    from zeropp.models import HFConfig
    from zeropp.models.hf import recorded_config

    return {"model": model_record(cfg)} | (
        {"transformers_config": recorded_config(cfg)} if isinstance(cfg, HFConfig) else {}
    )


def tokens(cfg: Any, seed: int = 0, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (batch, cfg.seq_len)
    return torch.randint(0, cfg.vocab_size, shape, generator=g), torch.randint(0, cfg.vocab_size, shape, generator=g)


def train_and_save(
    model: nn.Module, cfg: Any, path: Path, *, stage: int, steps: int = 1, record: bool = True
) -> dict[str, torch.Tensor]:
    """Train ``model`` (built from ``cfg``) ``steps`` steps with ZeroEngine at ``stage`` in the current
    world, save a checkpoint to ``path`` as the runner does (``record``: with the model settings),
    and return the trained weights (``consolidated_state_dict``: the reference)."""
    from zeropp.comm import Topology
    from zeropp.runtime import OptimizerConfig, ZeroConfig, ZeroEngine

    eng = ZeroEngine(
        model,
        config=ZeroConfig(stage=stage),
        optimizer=OptimizerConfig(lr=3e-2),  # large: every weight, the LoRA B's too, moves visibly
        topology=Topology(nodes=1, ranks_per_node=1),
    )
    try:
        for s in range(steps):
            eng.train_step([tokens(cfg, seed=s)])
        extra: dict[str, Any] = {"step": steps} | (runner_record(cfg) if record else {})
        eng.save_checkpoint(path, extra=extra)
        return eng.consolidated_state_dict()
    finally:
        eng.close()


def train_and_save_ddp(model: nn.Module, cfg: Any, path: Path) -> dict[str, torch.Tensor]:
    """As :func:`train_and_save` for ``trainer=ddp``: one AdamW step of DDP(``model``), saved as
    ``TorchTrainer.save`` saves (``experiments.trainers.save_dcp``, the checkpoint kind ``torch``)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.nn.parallel import DistributedDataParallel

    from zeropp.experiments.runner.torch_checkpoint import save_dcp

    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-2)
    ddp(*tokens(cfg))[1].backward()
    opt.step()
    model_sd, optim_sd = get_state_dict(ddp, opt)
    save_dcp({"model": model_sd, "optim": optim_sd}, path, {"step": 1, "model": model_record(cfg)})
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@torch.no_grad()
def our_logits(cfg: Any, state: dict[str, torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
    """Logits of our model (``build_hf_model(cfg)``, LoRA adapters unmerged) holding ``state``."""
    from zeropp.models import build_hf_model

    model = build_hf_model(cfg, seed=123)
    own = model.state_dict()  # a checkpoint also holds the buffers the model does not persist (rotary)
    model.load_state_dict({k: v for k, v in state.items() if k in own})
    return model.eval()(idx)[0]


def load_pretrained(out: Path) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained(out)``, offline, in eval mode."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()


@torch.no_grad()
def hf_logits(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    return model(input_ids=idx).logits


@torch.no_grad()
def runner_eval_loss(model: nn.Module, summary: dict[str, Any]) -> float:
    """The held-out loss of ``model`` (a ``transformers`` causal LM) on the batches the runner's final
    evaluation used (``experiments.worker._evaluate``: data-parallel rank ``r`` evaluates batch
    ``k * dp + r``, the loss is the mean over ranks and batches), rebuilt from ``summary.json``."""
    from zeropp.experiments.runner.config import from_dict
    from zeropp.experiments.runner.data import TokenBatches

    cfg = from_dict(summary["config"])

    dp, n = cfg.topology.dp_size, cfg.train.eval_batches
    losses = []
    for rank in range(dp):
        data = TokenBatches(
            cfg.data,
            seq_len=cfg.model.seq_len,
            batch=cfg.train.micro_batch_size,
            vocab_size=cfg.model.vocab_size,
            seed=cfg.train.seed,
            rank=rank,
            device=torch.device("cpu"),
        )
        for k in range(n):
            idx, tgt = data.eval_batch(k * dp + rank)
            logits = model(input_ids=idx).logits
            losses.append(float(F.cross_entropy(logits.float().view(-1, logits.size(-1)), tgt.reshape(-1))))
    return sum(losses) / len(losses)
