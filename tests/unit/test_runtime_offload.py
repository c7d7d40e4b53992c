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


def test_auto_runs_native_on_shards_from_the_threshold_and_fused_below(monkeypatch):
    """The offload's default kernel picks per shard: shards at and above the threshold go to the
    native kernel, the one just below it to torch's fused one (a kernel chosen once for all shards
    fails here), and each shard's state is that kernel's."""
    import torch

    from zeropp.kernels import cpu_adamw
    from zeropp.runtime import OptimizerConfig, optimizer
    from zeropp.runtime.offload import DEFAULT_CPU_KERNEL, HostAdamW

    if not cpu_adamw.available():
        pytest.skip(f"native CPU AdamW unavailable here: {cpu_adamw.FAILED}")
    assert DEFAULT_CPU_KERNEL == "auto"
    monkeypatch.setattr(optimizer, "AUTO_NATIVE_MIN_NUMEL", 4096)
    sizes, steps = (4095, 4096, 5000), 3
    g = torch.Generator().manual_seed(0)
    masters = [torch.randn(n, generator=g) for n in sizes]
    grads = [[torch.randn(n, generator=g) for n in sizes] for _ in range(steps)]

    def run(kernel: str) -> HostAdamW:
        opt = HostAdamW([m.clone() for m in masters], OptimizerConfig(lr=1e-2, weight_decay=0.1),
                        device=torch.device("cpu"), kernel=kernel)  # fmt: skip
        for gs in grads:
            opt.step([x.clone() for x in gs])
        return opt

    fused, native = run("fused"), run("native")
    calls = record_native_adamw(monkeypatch)
    auto = run("auto")
    assert calls == [4096, 5000] * steps
    for i, n in enumerate(sizes):
        want = native if n >= 4096 else fused
        for name in auto.STATE:
            assert torch.equal(auto.state_tensor(name, i), want.state_tensor(name, i)), (n, name)


def test_auto_threshold_and_where_it_does_not_apply():
    from zeropp.runtime.optimizer import AUTO_NATIVE_MIN_NUMEL, kernel_for

    assert AUTO_NATIVE_MIN_NUMEL == 1 << 21  # the measured threshold the docstrings state (2M)
    assert kernel_for("auto", AUTO_NATIVE_MIN_NUMEL) == "native"
    assert kernel_for("auto", AUTO_NATIVE_MIN_NUMEL - 1) == "fused"
    assert kernel_for("auto", 1 << 30, "cuda") == "fused"  # the native kernel runs on CPU tensors only
    for k in ("single", "foreach", "fused", "native", "native-exact"):
        assert kernel_for(k, 1) == kernel_for(k, 1 << 30) == k
