"""ZeRO-Offload / ZeRO-Infinity against the in-memory engine.

Here: the one-process checks. The topic's full description and its gloo-world checks are in
``tests/distributed/test_runtime_offload.py``.
"""

from __future__ import annotations

import pytest

from tests.runtime_helpers import make_model, record_native_adamw


def test_bad_offload_input_is_refused_before_training(tmp_path):
    from zeropp.runtime import ZeroConfig, ZeroEngine

    with pytest.raises(ValueError, match="offload_optimizer='cpu' needs stage >= 1"):
        ZeroConfig(stage=0, offload_optimizer="cpu")
    with pytest.raises(ValueError, match="offload_param='cpu' offloads stage-3"):
        ZeroConfig(stage=2, offload_param="cpu")
    with pytest.raises(ValueError, match="nvme_path=.*is not an existing directory"):
        ZeroConfig(stage=3, offload_param="nvme", nvme_path=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="needs nvme_path"):
        ZeroConfig(stage=1, offload_optimizer="nvme")
    with pytest.raises(ValueError, match="cpu_adam='avx512' is not a CPU AdamW kernel"):
        ZeroEngine(make_model(), config=ZeroConfig(stage=1, offload_optimizer="cpu"), cpu_adam="avx512")


def test_cpu_adam_picks_the_kernel_of_every_tier_and_is_never_ignored(tmp_path):
    """Unset: ``native`` offloaded, ``exact`` in memory. Given without offload it is the in-memory
    optimizer's kernel (before: silently ignored); a native kernel for state on a GPU (``meta``
    here) is refused when the optimizer is made, not at its first step."""
    import torch

    from zeropp.runtime import OptimizerConfig, ZeroConfig
    from zeropp.runtime.offload import make_optimizer

    def kernel(cfg: ZeroConfig, cpu_adam: str | None, device: str = "cpu") -> str:
        masters = [torch.zeros(8, device=device)]
        opt = make_optimizer(
            masters,
            OptimizerConfig(),
            cfg,
            device=torch.device(device),
            space=None,
            masters_are_params=False,
            cpu_adam=cpu_adam,
        )
        return opt.kernel

    memory, host = ZeroConfig(stage=1), ZeroConfig(stage=1, offload_optimizer="cpu")
    assert (kernel(memory, None), kernel(host, None)) == ("exact", "native")
    assert (kernel(memory, "fused"), kernel(host, "fused")) == ("fused", "fused")
    assert kernel(memory, "single", "meta") == "single"
    with pytest.raises(ValueError, match="cpu_adam='native' runs on CPU tensors, but without offload_optimizer"):
        kernel(memory, "native", "meta")


def test_both_offload_tiers_run_the_native_kernel_by_default(tmp_path, monkeypatch):
    """The offload default (engine, host tier, nvme tier): every element of every shard goes to the
    native kernel, chunk by chunk in the nvme tier, and both end with its bits."""
    import inspect

    import torch

    from zeropp.kernels import cpu_adamw
    from zeropp.runtime import OptimizerConfig, ShardedAdamW, ZeroEngine
    from zeropp.runtime.offload import DEFAULT_CPU_KERNEL, HostAdamW, SwappedAdamW
    from zeropp.runtime.swap import SwapSpace

    assert DEFAULT_CPU_KERNEL == "native"
    assert inspect.signature(ZeroEngine).parameters["cpu_adam"].default is None  # native when offloaded: below
    if not cpu_adamw.available():
        pytest.skip(f"native CPU AdamW unavailable here: {cpu_adamw.FAILED}")
    cfg, sizes, steps = OptimizerConfig(lr=1e-2, weight_decay=0.1), (5, 4099), 3
    g = torch.Generator().manual_seed(0)
    masters = [torch.randn(n, generator=g) for n in sizes]
    grads = [[torch.randn(n, generator=g) for n in sizes] for _ in range(steps)]
    ref = ShardedAdamW([m.clone() for m in masters], cfg, kernel="native")
    for gs in grads:
        ref.step(gs)
    calls = record_native_adamw(monkeypatch)
    sp = SwapSpace(tmp_path, 0, buffers=3, buffer_size=1000)  # chunks of 320 elements
    try:
        for opt in (
            HostAdamW([m.clone() for m in masters], cfg, device=torch.device("cpu")),
            SwappedAdamW([m.clone() for m in masters], cfg, space=sp),
        ):
            calls.clear()
            for gs in grads:
                opt.step([x.clone() for x in gs])
            assert sum(calls) == steps * sum(sizes), type(opt).__name__
            for name in ShardedAdamW.STATE:
                for i in range(len(sizes)):
                    assert torch.equal(opt.state_tensor(name, i), ref.state_tensor(name, i)), (name, i)
    finally:
        sp.close()
