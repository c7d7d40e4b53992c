"""Shared pieces of the runtime tests: deterministic data, a single-process reference trainer,
and rank functions for ``run_world`` (module-level so they pickle by name)."""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
from pathlib import Path
from typing import Any, Iterator

import torch

from zeropp.models import GPT, GPTConfig, byte_batch

TINY = GPTConfig(d_model=32, n_layers=2, n_heads=2, seq_len=16)
MICRO_B = 2  # sequences per rank per micro-batch


def micro_batch(
    step: int, micro: int, rank: int, cfg: GPTConfig = TINY, batch: int = MICRO_B
) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batch rank ``rank`` sees at (step, micro): random bytes, reproducible anywhere."""
    g = torch.Generator().manual_seed(1_000_003 * step + 1009 * micro + rank)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=g)  # [B, T+1]
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


CORPUS = (
    b"ZeRO++ cuts cross-node traffic four times: quantized weights, hierarchical partitions, "
    b"quantized gradients. The quick brown fox jumps over the lazy dog. "
) * 8


def text_batch(
    step: int, micro: int, rank: int, cfg: GPTConfig = TINY, batch: int = MICRO_B
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like :func:`micro_batch` but windows of a fixed English text, so the loss can fall."""
    g = torch.Generator().manual_seed(1_000_003 * step + 1009 * micro + rank)
    return byte_batch(CORPUS, batch, cfg.seq_len, g)


def rank_batches(
    step: int, accum: int, rank: int, cfg: GPTConfig = TINY, text: bool = False
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    fn = text_batch if text else micro_batch
    return [fn(step, j, rank, cfg) for j in range(accum)]


def make_model(cfg: GPTConfig = TINY, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def reference_train(
    steps: int,
    world: int,
    accum: int,
    *,
    lr: float,
    wd: float,
    clip: float | None,
    cfg: GPTConfig = TINY,
    device: str = "cpu",
    model: torch.nn.Module | None = None,
) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """Single-process training on the same global batch: for each micro index, every rank's
    micro-batch concatenated; torch.optim.AdamW over the trainable parameters and
    clip_grad_norm_, on ``device``. ``model``: the unwrapped model to train (``forward(idx,
    targets) -> (logits, loss)``; default ``make_model(cfg)``). Returns (losses, norms, weights on
    the CPU)."""
    model = (make_model(cfg) if model is None else model).to(device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=wd, foreach=False)
    losses, norms = [], []
    for s in range(steps):
        opt.zero_grad()
        tot = 0.0
        for j in range(accum):
            parts = [micro_batch(s, j, r, cfg) for r in range(world)]
            idx = torch.cat([p[0] for p in parts]).to(device)
            tgt = torch.cat([p[1] for p in parts]).to(device)
            _, loss = model(idx, tgt)
            (loss / accum).backward()
            tot += loss.item()
        n = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip is not None else math.inf)
        norms.append(float(n))
        opt.step()
        losses.append(tot / accum)
    return losses, norms, {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def outcome(fn: Any) -> str:
    """``fn()``'s error as ``"Type: message"``, or ``"no error"``: a rank function's result that
    pickles and compares across ranks."""
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def rel_err(a: Any, b: Any) -> float:
    """Norm-relative difference ||a - b|| / ||b|| (elementwise relative error is meaningless
    where Adam's normalised update makes near-zero gradients move weights by a full lr)."""
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def train_engine(
    rank: int,
    world: int,
    zero_kwargs: dict[str, Any],
    *,
    steps: int,
    nodes: int,
    lr: float = 1e-3,
    wd: float = 0.01,
    cfg: GPTConfig = TINY,
    consolidate: bool = True,
    text: bool = False,
    device: str = "cpu",
) -> dict[str, Any]:
    """Train one engine for ``steps`` steps inside a world, model and batches on ``device``;
    returns losses, norms, comm, memory, weights."""
    from zeropp.comm import Topology
    from zeropp.runtime import OptimizerConfig, ZeroConfig, ZeroEngine

    zc = ZeroConfig(**zero_kwargs)
    eng = ZeroEngine(
        make_model(cfg).to(device),
        config=zc,
        optimizer=OptimizerConfig(lr=lr, weight_decay=wd),
        topology=Topology(nodes=nodes, ranks_per_node=world // nodes),
    )
    try:
        results, per_step = [], []
        for s in range(steps):
            results.append(
                eng.train_step(
                    [(i.to(device), t.to(device)) for i, t in rank_batches(s, zc.grad_accum_steps, rank, cfg, text)]
                )
            )
            per_step.append(eng.comm_stats.snapshot())  # cumulative after step s
        out = {
            "comm_per_step": per_step,
            "losses": [r.loss for r in results],
            "norms": [r.grad_norm for r in results],
            "skipped": [r.skipped for r in results],
            "wait": [r.comm_wait_s for r in results],
            "memory": eng.memory_report(),
            "comm": eng.comm_stats.snapshot(),
            "num_params": eng.num_params,
            "scales": [r.loss_scale for r in results],
            "calls": eng.comm_stats.calls(),
            "stochastic_calls": eng.comm_session.stochastic.value,
            "transport": str(eng.transport),
        }
        if consolidate:
            # numpy, not tensors: torch's queue would share tensors by fd, which dies with the process
            out["weights"] = {k: v.numpy() for k, v in eng.consolidated_state_dict().items()}
        return out
    finally:
        eng.close()


def parity_world(
    rank: int,
    world: int,
    nodes: int,
    configs: list[dict[str, Any]],
    steps: int,
    device: str = "cpu",
    cfg: GPTConfig = TINY,
) -> list[dict[str, Any]]:
    """Several engines, one after another, in one world launch (a launch costs seconds)."""
    res = [train_engine(rank, world, kw, steps=steps, nodes=nodes, device=device, cfg=cfg) for kw in configs]
    return res if rank == 0 else [{"losses": r["losses"]} for r in res]


def nccl_world(rank: int, world: int, store_path: str) -> None:
    """In a ``run_world`` rank (gloo world already up): replace it with an NCCL world on GPU
    ``rank``, through a file store at ``store_path`` (the cuda tests' multi-GPU setup)."""
    import torch.distributed as dist

    dist.destroy_process_group()
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        store=dist.FileStore(store_path, world),
        rank=rank,
        world_size=world,
        device_id=torch.device("cuda", rank),
    )


def check_offload_model_host_bytes(device: str) -> None:
    """The GPT (SDPA output saved whole and as the projection's input view; q, k, v): with and
    without checkpointing the host (pinned on CUDA) holds exactly the device path's bytes,
    gradients exact."""
    from zeropp.runtime.activations import ActivationStore, checkpoint_blocks

    model = make_model(TINY).to(device)
    idx, tgt = (t.to(device) for t in rank_batches(0, 1, 0)[0])
    _, loss = model(idx, tgt)
    loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    for ckpt in (False, True):
        handle = checkpoint_blocks(list(model.blocks)) if ckpt else None
        tiers = []
        for offload in (False, True):
            model.zero_grad(set_to_none=True)
            store = ActivationStore(torch.device(device), offload=offload)
            with store.saving():
                _, loss2 = model(idx, tgt)
            loss2.backward()
            tiers.append(store.memory_by_tier())
            assert torch.equal(loss, loss2)
            for n, p in model.named_parameters():
                assert torch.equal(p.grad, ref[n]), (ckpt, offload, n)
        assert tiers[1] == {"device": 0, "host": tiers[0]["device"], "disk": 0}, (ckpt, tiers)
        if handle is not None:
            handle.remove()


def record_native_adamw(monkeypatch: Any) -> list[int]:
    """Make every call of the native CPU AdamW kernel (``zeropp.kernels.cpu_adamw.adamw``) append
    the element count of each tensor it updates to the returned list, then run as before: which
    shards (or chunks) went to the native kernel, whatever their bits."""
    from zeropp.kernels import cpu_adamw

    calls: list[int] = []
    real = cpu_adamw.adamw

    def adamw(params, *args: Any, **kwargs: Any) -> None:
        calls.extend(p.numel() for p in params)
        real(params, *args, **kwargs)

    monkeypatch.setattr(cpu_adamw, "adamw", adamw)
    return calls


_PUBLIC_COLLECTIVES = ("quantized_all_gather", "quantized_reduce_scatter")


def spied_train_engine(
    rank: int, world: int, kwargs: dict[str, Any], nodes: int, device: str = "cpu"
) -> dict[str, Any]:
    """``train_engine`` for 2 steps, with the public collectives (``zeropp.comm.quantized_all_gather`` /
    ``quantized_reduce_scatter``) the engine calls recorded under ``"public"`` as ``(name, kind)``."""
    import zeropp.comm as zc

    calls: list[tuple[str, str]] = []
    saved = {name: getattr(zc, name) for name in _PUBLIC_COLLECTIVES}

    def spy(name: str):
        def call(*args: Any, **kw: Any) -> Any:
            calls.append((name, str(kw.get("kind"))))
            return saved[name](*args, **kw)

        return call

    for name in _PUBLIC_COLLECTIVES:
        setattr(zc, name, spy(name))
    try:
        out = train_engine(rank, world, kwargs, steps=2, nodes=nodes, device=device)
    finally:
        for name, fn in saved.items():
            setattr(zc, name, fn)
    out["public"] = calls
    return out


@contextlib.contextmanager
def tiny_tmpfs(tmp_path: Path, size: str = "64k") -> Iterator[Path]:
    """A directory under ``tmp_path`` on a freshly mounted tmpfs of ``size`` (a disk that fills up
    at once), unmounted on exit; the test is skipped where that needs root we lack or mounting fails."""
    import pytest

    if os.geteuid() != 0:
        pytest.skip("mounting a tiny tmpfs needs root")
    d = tmp_path / "tiny"
    d.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], capture_output=True)
