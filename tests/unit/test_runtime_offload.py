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
    assert inspect.signature(ZeroEngine).parameters["cpu_adam"].default == "native"
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
