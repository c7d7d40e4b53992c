"""The FSDP2 and DDP plug-ins given a model whose dtype their quantized specs cannot take
(float64): a clear ValueError from the step that meets it, on every rank, naming the plug-in's
own setting, and the world goes on (the next collective pairs up). DDP's future carries a
continuation's error only as a value it fails to cast, so the hook refuses such a bucket on DDP's
own thread, before anything is sent; FSDP2's weight gather used to send float64 unquantized,
ignoring the spec."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tests.worlds import run_world
from zeropp.comm import QuantSpec, Topology


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).double()


def _ddp(rank: int, world: int) -> dict[str, object]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zeropp.comm.ddp import QuantizedAllReduceState, quantized_allreduce_hook

    topo = Topology.single_node(world)
    out: dict[str, object] = {}
    for name, state in {
        "grads": QuantizedAllReduceState(grads=QuantSpec(bits=8), topology=topo),
        "gather": QuantizedAllReduceState(grads=None, gather=QuantSpec(bits=8), topology=topo),
    }.items():
        ddp = DDP(_model())
        ddp.register_comm_hook(state, quantized_allreduce_hook)
        try:
            ddp(torch.randn(4, 8, dtype=torch.float64)).sum().backward()
            out[name] = None
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"
    plain = DDP(_model())  # a plain hook state reduces float64 as DDP does
    plain.register_comm_hook(QuantizedAllReduceState(grads=None, topology=topo), quantized_allreduce_hook)
    plain(torch.full((4, 8), float(rank), dtype=torch.float64)).sum().backward()
    ref = DDP(_model())
    ref(torch.full((4, 8), float(rank), dtype=torch.float64)).sum().backward()
    out["plain"] = all(torch.allclose(a.grad, b.grad) for a, b in zip(plain.parameters(), ref.parameters()))
    t = torch.ones(1)
    dist.all_reduce(t)  # the world is still in step
    out["after"] = t.item()
    return out


def test_ddp_hook_refuses_a_float64_bucket_with_a_clear_error() -> None:
    for r in run_world(_ddp, 2):
        for name in ("grads", "gather"):
            msg = r[name]
            assert isinstance(msg, str) and msg.startswith("ValueError: quantized_allreduce_hook"), msg
            assert "is torch.float64" in msg and "QuantizedAllReduceState(grads=None, gather=None)" in msg, msg
            assert "Unable to cast" not in msg, msg
        assert r["plain"] is True and r["after"] == 2.0, r


def _fsdp(rank: int, world: int) -> dict[str, object]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from zeropp.comm.fsdp import apply_zeropp_comms

    topo = Topology.single_node(world)
    out: dict[str, object] = {}
    for name, specs, mp in [
        ("weights", {"weights": QuantSpec(bits=8)}, None),
        ("grads", {"grads": QuantSpec(bits=4)}, None),
        ("cast to fp32", {"weights": QuantSpec(bits=8), "grads": QuantSpec(bits=4)}, torch.float32),
    ]:
        model = _model()
        policy = MixedPrecisionPolicy(param_dtype=mp, reduce_dtype=mp) if mp is not None else MixedPrecisionPolicy()
        for layer in (model[0], model[2]):
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        apply_zeropp_comms(model, topology=topo, **specs)
        try:
            model(torch.randn(4, 8, dtype=torch.float64)).sum().backward()
            out[name] = None
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"
    t = torch.ones(1)
    dist.all_reduce(t)  # the world is still in step
    out["after"] = t.item()
    return out


def test_fsdp2_plugin_refuses_float64_under_a_quantized_spec() -> None:
    for r in run_world(_fsdp, 2):
        for name, which in (("weights", "weights=None"), ("grads", "grads=None")):
            msg = r[name]
            assert isinstance(msg, str) and msg.startswith("ValueError: apply_zeropp_comms: FSDP2"), (name, msg)
            assert "as torch.float64" in msg and which in msg, (name, msg)
        assert r["cast to fp32"] is None and r["after"] == 2.0, r
