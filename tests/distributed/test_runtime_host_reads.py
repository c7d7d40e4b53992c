"""The engine reads one device value back per training step.

Here: the gloo-world checks. The topic's full description and its CUDA checks are in
``tests/gpu/test_runtime_host_reads.py``; its one-process checks are in
``tests/unit/test_runtime_host_reads.py``.
"""

from __future__ import annotations

from tests.host_reads import HostRead, host_reads
from tests.runtime_helpers import make_model, rank_batches
from tests.worlds import run_world
from zeropp.comm.spec import QuantSpec

ONE_READ = HostRead("zeropp/runtime/update.py:read_totals", "tolist", "cpu")
"""The step's one read: the all-reduced [loss, squared norms]."""

HOST_GROUP_READ = ("zeropp/runtime/batch.py:host_max", "zeropp/runtime/batch.py:read_host_max")
"""The per-micro-step agreement of host ints: a tensor made on the host from Python ints."""

CONFIGS = {
    "s0": dict(stage=0, grad_accum_steps=2, grad_clip=1.0),
    "s2_qgz": dict(stage=2, grads=QuantSpec(bits=8)),
    "s3_zeropp_fp16": dict(
        stage=3,
        precision="fp16",
        loss_scale_init=2.0**18,
        weights=QuantSpec(bits=8),
        grads=QuantSpec(bits=4),
        hpz=True,
        grad_accum_steps=2,
        grad_clip=1.0,
    ),
    "s3_offload": dict(stage=3, offload_optimizer="cpu", offload_param="nvme", swap_buffers=3, swap_buffer_size=1000),
}
STEPS = 2


def _count(rank: int, world: int, nvme: str) -> dict[str, list[list[HostRead]]]:
    """Per config: the library's host reads during each ``train_step`` of this rank."""
    from zeropp.runtime import OptimizerConfig, ZeroConfig, ZeroEngine

    out = {}
    for name, kw in CONFIGS.items():
        zc = ZeroConfig(**kw, **({"nvme_path": nvme} if "nvme" in kw.values() else {}))
        eng = ZeroEngine(make_model(), config=zc, optimizer=OptimizerConfig(lr=1e-3))
        try:
            steps = []
            for s in range(STEPS):
                batches = rank_batches(s, zc.grad_accum_steps, rank)
                with host_reads() as reads:
                    eng.train_step(batches)
                steps.append(reads)
            out[name] = steps
        finally:
            eng.close()
    out["control"] = _control_group_under_nccl(rank)
    return out


def _control_group_under_nccl(rank: int) -> list:
    """``batch.control_group`` as an NCCL default group would have it: a second (gloo) group on
    which ``host_max`` agrees over the ranks; none where the default group carries CPU tensors."""
    import torch.distributed as dist

    from zeropp.runtime.batch import control_group, host_max

    group = control_group("nccl")
    try:
        got = host_max([rank, -rank], group)
    finally:
        dist.destroy_process_group(group)
    return [group is not None, got, control_group("gloo"), control_group("cpu:gloo,cuda:nccl")]


def test_a_training_step_reads_one_device_value(tmp_path):
    """Two ranks (the agreement paths run only with more than one); stages 0, 2 and 3; ZeRO++'s
    quantized and hierarchical paths; fp16; gradients landing on the host (CPU optimizer) and
    parameters fetched from the nvme tier; gradient accumulation and clipping: each step reads the device once, in ``read_totals``; every other read is of a host
    int vector in ``host_max`` (per micro-step: the forward agreement; stages 2-3's late gradients are
    counted in ``read_totals``' all-reduce, so they need no read of their own)."""
    per_rank = run_world(_count, 2, str(tmp_path), timeout=180)
    for rank, res in enumerate(per_rank):
        assert res.pop("control") == [True, [1, 0], None, None]
        for name, steps in res.items():
            for s, reads in enumerate(steps):
                device_reads = [r for r in reads if r.where not in HOST_GROUP_READ]
                assert device_reads == [ONE_READ], (rank, name, s, reads)
                assert all(r.how == "tolist" and r.device == "cpu" for r in reads if r.where in HOST_GROUP_READ)
                accum = CONFIGS[name].get("grad_accum_steps", 1)
                assert len(reads) - 1 == accum, (rank, name, s, reads)
